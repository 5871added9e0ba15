"""Chat templates and the reasoning format.

Expected strings are written out by hand from each family's documented format (the no-tools
branch of its Hugging Face chat template). The functions were also checked once, outside this
suite, against the real jinja templates rendered by transformers' `apply_chat_template`
(Llama 3.1, Qwen2, Qwen2.5, Qwen3 with thinking on and off, Gemma 1 and Gemma 3) on 420
conversations each: identical strings, and identical ids through `encode_prompt`. The
templates themselves are not vendored here.
"""

import pytest

from rlscale.tokenizers import chat, train_sentencepiece

SYS = {"role": "system", "content": "Be brief."}
Q = {"role": "user", "content": "What is 1+1?"}
A = {"role": "assistant", "content": "2"}
Q2 = {"role": "user", "content": "And 2+2?"}


def test_llama3():
    assert chat.llama3([Q]) == (
        "<|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 1+1?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    # The system message joins the date block; contents are trimmed.
    padded = [
        {"role": "system", "content": " Be brief.\n"},
        {"role": "user", "content": " q \n"},
        A,
    ]
    assert chat.llama3(padded, add_generation_prompt=False, date_string="01 Jan 2025") == (
        "<|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 01 Jan 2025\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nq<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n2<|eot_id|>"
    )


def test_qwen2_and_qwen2_5_default_system_prompts():
    tail = "<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n"
    assert chat.qwen2([Q]) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" + tail
    )
    assert chat.qwen2_5([Q]) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n" + tail
    )
    # A given system message replaces the default; contents are not trimmed.
    conv = [SYS, {"role": "user", "content": " q\n"}, A, Q2]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n q\n<|im_end|>\n"
        "<|im_start|>assistant\n2<|im_end|>\n<|im_start|>user\nAnd 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert chat.qwen2(conv) == chat.qwen2_5(conv) == expected


def test_qwen3_thinking_and_history():
    assert chat.qwen3([Q]) == "<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n"
    assert chat.qwen3([SYS, Q], enable_thinking=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 1+1?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    thought = {"role": "assistant", "content": "<think>\n1 and 1\n</think>\n\nIt is 2."}
    # Before the last user message the reasoning is dropped ...
    assert chat.qwen3([Q, thought, Q2]) == (
        "<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\nIt is 2.<|im_end|>\n"
        "<|im_start|>user\nAnd 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    # ... after it, kept; the final assistant turn always gets a think block.
    assert chat.qwen3([Q, thought], add_generation_prompt=False) == (
        "<|im_start|>user\nWhat is 1+1?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n1 and 1\n</think>\n\nIt is 2.<|im_end|>\n"
    )
    assert chat.qwen3([Q, A], add_generation_prompt=False) == (
        "<|im_start|>user\nWhat is 1+1?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n2<|im_end|>\n"
    )
    with_field = {"role": "assistant", "content": "2", "reasoning_content": "\nadd\n"}
    assert chat.qwen3([Q, with_field], add_generation_prompt=False).endswith(
        "<|im_start|>assistant\n<think>\nadd\n</think>\n\n2<|im_end|>\n"
    )


def test_gemma():
    assert chat.gemma([Q, A, Q2]) == (
        "<start_of_turn>user\nWhat is 1+1?<end_of_turn>\n<start_of_turn>model\n2<end_of_turn>\n"
        "<start_of_turn>user\nAnd 2+2?<end_of_turn>\n<start_of_turn>model\n"
    )
    # The system message opens the first user turn (Gemma 3); contents are trimmed.
    assert chat.gemma([SYS, {"role": "user", "content": "  q \n"}]) == (
        "<start_of_turn>user\nBe brief.\n\nq<end_of_turn>\n<start_of_turn>model\n"
    )
    with pytest.raises(ValueError, match="must alternate"):
        chat.gemma([Q, Q2])
    with pytest.raises(ValueError, match="must alternate"):
        chat.gemma([A])


@pytest.mark.parametrize("family", sorted(chat.TEMPLATES))
def test_every_family_ends_with_its_assistant_header(family):
    t = chat.get(family)
    prompt = t.prompt("What is 1+1?", system="Be brief.")
    assert prompt == t([SYS, Q])
    # The generation prompt is the conversation without it, plus the assistant header.
    header = {
        "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "gemma": "<start_of_turn>model\n",
    }.get(family, "<|im_start|>assistant\n")
    assert prompt == t([SYS, Q], add_generation_prompt=False) + header
    # An assistant turn ends with the family's end-of-turn token.
    done = t([SYS, Q, A], add_generation_prompt=False)
    assert done.endswith(t.end_of_turn + "\n") or done.endswith(t.end_of_turn)
    assert t.bos_token is None or t.bos_token not in prompt


@pytest.mark.parametrize(
    "messages, message",
    [
        ([], "at least one message"),
        ([{"role": "tool", "content": "x"}], "role 'tool'"),
        ([Q, SYS], "system message may only come first"),
        ([{"role": "user", "content": None}], "content must be a string"),
    ],
)
def test_bad_conversations(messages, message):
    for family in chat.TEMPLATES:
        with pytest.raises(ValueError, match=message):
            chat.get(family)(messages)


def test_unknown_family():
    with pytest.raises(ValueError, match="unknown chat template 'llama2'"):
        chat.get("llama2")


@pytest.fixture(scope="module")
def sp_tok():
    corpus = ["What is 1+1? It is 2.", "Considering the limited time, I have to give the solution"]
    return train_sentencepiece(
        corpus * 20,
        400,
        user_defined_symbols=["<think>", "</think>", "<|im_end|>"],
        hard_vocab_limit=False,
    )


def test_encode_prompt_adds_bos_only_when_the_tokenizer_has_one(sp_tok):
    text = chat.qwen3([Q])
    assert chat.encode_prompt(sp_tok, text) == [sp_tok.bos_id, *sp_tok.encode(text)]


def test_stop_token_ids(sp_tok):
    t = chat.get("qwen3")
    assert chat.stop_token_ids(sp_tok, t) == (sp_tok.token_id("<|im_end|>"), sp_tok.eos_id)
    with pytest.raises(ValueError, match="'<end_of_turn>' is not in the vocabulary"):
        chat.stop_token_ids(sp_tok, chat.get("gemma"))


def test_reasoning_format_round_trip():
    completion = chat.reasoning_completion("\n1 and 1 make 2\n", "\n\\boxed{2}")
    assert completion == "<think>\n1 and 1 make 2\n</think>\n\n\\boxed{2}"
    assert chat.split_reasoning(completion) == ("1 and 1 make 2", "\\boxed{2}")
    # The prompt may open the block itself; the last </think> decides.
    assert chat.split_reasoning("a </think> b</think>\n\nc") == ("a </think> b", "c")
    # Thinking that never ended has no answer.
    assert chat.split_reasoning("<think>\nstill going") == ("still going", None)


def test_forced_interruption_closes_the_thinking(sp_tok):
    assert chat.FORCED_INTERRUPTION.endswith("</think>\n\n")
    interrupted = "<think>\nlet me see" + chat.FORCED_INTERRUPTION + "\\boxed{2}"
    thinking, answer = chat.split_reasoning(interrupted)
    assert answer == "\\boxed{2}"
    assert thinking.startswith("let me see\n\nConsidering the limited time")
    ids = chat.interruption_ids(sp_tok)
    assert sp_tok.decode(ids) == chat.FORCED_INTERRUPTION
    assert sp_tok.token_id("</think>") in ids
