"""Chat templates of the supported families (llama3, qwen2, qwen2.5, qwen3, gemma), each reproducing
its Hugging Face template's no-tools branch, and the reasoning format (`<think>...</think>`, forced
interruption). The BOS is added by `encode_prompt`, not the template. Formats and how they were
checked: docs/hugging_face.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from rlscale.tokenizers.interface import Tokenizer

Message = Mapping[str, str]
ROLES = ("system", "user", "assistant")

THINK_START = "<think>"
THINK_END = "</think>"
# Appended when the thinking budget is spent: the model is told to stop and answer (after the
# Qwen3 report's thinking-budget interruption). It closes the think block itself.
FORCED_INTERRUPTION = (
    "\n\nConsidering the limited time, I have to give the solution based on the thinking "
    "directly now.\n</think>\n\n"
)

# The Llama 3.1 template's date when the caller gives none (Llama 3.2's uses today's date).
LLAMA3_DATE = "26 Jul 2024"
QWEN2_SYSTEM = "You are a helpful assistant."
QWEN2_5_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def _check(messages: Sequence[Message]) -> list[Message]:
    messages = list(messages)
    if not messages:
        raise ValueError("a conversation needs at least one message")
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"message {i}: role {role!r} is not one of {ROLES}")
        if not isinstance(content, str):
            raise ValueError(f"message {i}: content must be a string, got {type(content)}")
        if role == "system" and i > 0:
            raise ValueError(f"message {i}: a system message may only come first")
    return messages


def llama3(
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
    date_string: str = LLAMA3_DATE,
) -> str:
    """Llama 3.1+ Instruct chat format (without the leading `<|begin_of_text|>`).

    The system turn is always present: the knowledge-cutoff and date lines, then the system
    message (stripped), if any. Every other turn's content is stripped of surrounding
    whitespace, as the template's `| trim` does.

    Args:
      messages: The conversation.
      add_generation_prompt: Whether to end with the assistant header.
      date_string: The "Today Date" line (the Llama 3.1 template's default; Llama 3.2's
        template writes the current date, pass it here to reproduce that).
    """
    messages = _check(messages)
    system = ""
    if messages[0]["role"] == "system":
        system, messages = messages[0]["content"].strip(), messages[1:]
    parts = [
        "<|start_header_id|>system<|end_header_id|>\n\n"
        f"Cutting Knowledge Date: December 2023\nToday Date: {date_string}\n\n"
        f"{system}<|eot_id|>"
    ]
    for m in messages:
        parts.append(
            f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>"
        )
    if add_generation_prompt:
        parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(parts)


def _chatml(messages: list[Message], default_system: str | None) -> list[str]:
    parts = []
    if messages[0]["role"] != "system" and default_system is not None:
        parts.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
    for m in messages:
        parts.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    return parts


def qwen2(messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
    """Qwen2 Instruct (ChatML; default system prompt "You are a helpful assistant.")."""
    parts = _chatml(_check(messages), QWEN2_SYSTEM)
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def qwen2_5(messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
    """Qwen2.5 (ChatML; default system prompt "You are Qwen, created by Alibaba Cloud...")."""
    parts = _chatml(_check(messages), QWEN2_5_SYSTEM)
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def qwen3(
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
    enable_thinking: bool = True,
) -> str:
    """Qwen3 (ChatML, no default system prompt, reasoning-aware assistant turns).

    An assistant message's reasoning is its `reasoning_content` field or, failing that, the
    text before its last `</think>`. Assistant turns after the last user message are written
    as `<think>\\n{reasoning}\\n</think>\\n\\n{answer}` (the last turn always; earlier ones only
    when they have reasoning); turns before it keep only the answer.

    Args:
      messages: The conversation.
      add_generation_prompt: Whether to end with the assistant header.
      enable_thinking: If False, the generation prompt also closes an empty think block,
        which switches the model's thinking off.
    """
    messages = _check(messages)
    # The last user message that is not a wrapped tool response, as the template finds it.
    last_query = max(
        (
            i
            for i, m in enumerate(messages)
            if m["role"] == "user"
            and not (
                m["content"].startswith("<tool_response>")
                and m["content"].endswith("</tool_response>")
            )
        ),
        default=len(messages) - 1,
    )
    parts = []
    for i, m in enumerate(messages):
        content = m["content"]
        if m["role"] != "assistant":
            parts.append(f"<|im_start|>{m['role']}\n{content}<|im_end|>\n")
            continue
        reasoning = m.get("reasoning_content")
        if not isinstance(reasoning, str):
            reasoning = ""
            if THINK_END in content:
                reasoning = content.split(THINK_END)[0].rstrip("\n").split(THINK_START)[-1]
                reasoning = reasoning.lstrip("\n")
                content = content.split(THINK_END)[-1].lstrip("\n")
        if i > last_query and (i == len(messages) - 1 or reasoning):
            body = reasoning_completion(reasoning, content)
        else:
            body = content
        parts.append(f"<|im_start|>assistant\n{body}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
        if not enable_thinking:
            parts.append(f"{THINK_START}\n\n{THINK_END}\n\n")
    return "".join(parts)


def gemma(messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
    """Gemma chat format (without the leading `<bos>`); the assistant's role is `model`.

    Contents are stripped of surrounding whitespace (`| trim`). A system message is written,
    followed by a blank line, at the start of the first user turn (Gemma 3's convention).

    Raises:
      ValueError: If the roles after the system message do not alternate user, assistant,
        user, ...
    """
    messages = _check(messages)
    prefix = ""
    if messages[0]["role"] == "system":
        prefix, messages = messages[0]["content"] + "\n\n", messages[1:]
    parts = []
    for i, m in enumerate(messages):
        if (m["role"] == "user") != (i % 2 == 0):
            raise ValueError(
                "gemma: conversation roles must alternate user/assistant/user/... "
                f"(message {i} is {m['role']!r})"
            )
        role = "model" if m["role"] == "assistant" else "user"
        parts.append(
            f"<start_of_turn>{role}\n{prefix if i == 0 else ''}"
            f"{m['content'].strip()}<end_of_turn>\n"
        )
    if add_generation_prompt:
        parts.append("<start_of_turn>model\n")
    return "".join(parts)


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A family's chat format.

    Attributes:
      family: Its name in `TEMPLATES`.
      render: `render(messages, add_generation_prompt=True, **options) -> str`.
      bos_token: The BOS token the family's Hugging Face template writes first, which
        `render` leaves out (`encode_prompt` adds its id), or None.
      end_of_turn: The token that ends an assistant turn: a stop token when sampling.
    """

    family: str
    render: Callable[..., str]
    bos_token: str | None
    end_of_turn: str

    def __call__(self, messages: Sequence[Message], **options) -> str:
        return self.render(messages, **options)

    def prompt(self, user: str, system: str | None = None, **options) -> str:
        """The generation prompt for one user message (after an optional system message)."""
        messages = [{"role": "system", "content": system}] if system is not None else []
        return self.render([*messages, {"role": "user", "content": user}], **options)


TEMPLATES = {
    "llama3": ChatTemplate("llama3", llama3, "<|begin_of_text|>", "<|eot_id|>"),
    "qwen2": ChatTemplate("qwen2", qwen2, None, "<|im_end|>"),
    "qwen2.5": ChatTemplate("qwen2.5", qwen2_5, None, "<|im_end|>"),
    "qwen3": ChatTemplate("qwen3", qwen3, None, "<|im_end|>"),
    "gemma": ChatTemplate("gemma", gemma, "<bos>", "<end_of_turn>"),
}


def get(family: str) -> ChatTemplate:
    """The chat template of a model family (a key of `TEMPLATES`)."""
    if family not in TEMPLATES:
        raise ValueError(f"unknown chat template {family!r}; known: {', '.join(TEMPLATES)}")
    return TEMPLATES[family]


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    """A prompt's ids: the BOS id (when the tokenizer has one), then the text's ids."""
    return tokenizer.encode(text, add_bos=tokenizer.bos_id >= 0)


def stop_token_ids(tokenizer: Tokenizer, template: ChatTemplate) -> tuple[int, ...]:
    """Ids that end the assistant's turn: the template's end-of-turn token and the EOS."""
    ids = [tokenizer.token_id(template.end_of_turn)]
    if tokenizer.eos_id >= 0 and tokenizer.eos_id not in ids:
        ids.append(tokenizer.eos_id)
    return tuple(ids)


# ------------------------------------------------------------------------------------------
# Reasoning format.
# ------------------------------------------------------------------------------------------


def reasoning_completion(thinking: str, answer: str) -> str:
    """A completion in the reasoning format: `<think>\\n{thinking}\\n</think>\\n\\n{answer}`."""
    thinking, answer = thinking.strip("\n"), answer.lstrip("\n")
    return f"{THINK_START}\n{thinking}\n{THINK_END}\n\n{answer}"


def split_reasoning(completion: str) -> tuple[str, str | None]:
    """Splits a completion into (thinking, answer) at its last `</think>`.

    The thinking loses a leading `<think>` (absent when the prompt opened the block) and
    surrounding newlines. The answer is None when the thinking never ended: such a completion
    has no answer (the math verifier scores it 0).
    """
    if THINK_END not in completion:
        thinking = completion.split(THINK_START, 1)[-1]
        return thinking.strip("\n"), None
    thinking, answer = completion.rsplit(THINK_END, 1)
    thinking = thinking.split(THINK_START, 1)[-1]
    return thinking.strip("\n"), answer.lstrip("\n")


def interruption_ids(tokenizer: Tokenizer) -> list[int]:
    """`FORCED_INTERRUPTION` as ids, to append to a completion whose thinking budget ran out."""
    return tokenizer.encode(FORCED_INTERRUPTION)
