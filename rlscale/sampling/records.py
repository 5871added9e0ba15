"""What goes into the generator engine and what comes out (`sampling.generator`): a
`Request`, its `Completed` samples, the `Turn`s that wait for an environment's reply, one
`step`'s result (`Stepped`) and the engine's counters (`EngineStats`).

Dimension letters: G samples per request, M max new tokens, L a row's prompt bucket + M, l
sparse layers, c experts per token.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np


@dataclasses.dataclass
class Request:
    """A prompt to sample `SamplingConfig.num_samples` completions of.

    Attributes:
      id: the caller's handle, returned with the completions.
      prompt: token ids.
      key: a PRNG key; sample g draws with fold_in(key, g).
      max_new_tokens: this request's budget (0: the config's).
    """

    id: Any
    prompt: Sequence[int]
    key: jax.Array
    max_new_tokens: int = 0


class Completed(NamedTuple):
    """A request's G completions (host arrays, [G, M]); see `sampler.SampleOutput` for the
    fields they share. `versions_GM` is the policy version that sampled each token (-1 for
    environment tokens). In a multi-turn episode the completion holds the policy's turns and
    the environment's replies between them, each token as it was sampled or replied:
    `env_GM` is True on the replies' tokens (inside `mask_GM`, logprob 0: a learner leaves
    them out of the loss), and `truncated_G` is False for an episode the environment
    ended. `experts_GLlc` (a mixture of experts only, else None): the experts each token of
    the row went to, its prompt left-padded to its bucket P then its M completion columns
    (L = P + M; `sampler.SampleOutput.experts`)."""

    request: Request
    tokens_GM: np.ndarray
    mask_GM: np.ndarray
    logprobs_GM: np.ndarray
    versions_GM: np.ndarray
    forced_GM: np.ndarray
    lengths_G: np.ndarray
    truncated_G: np.ndarray
    interrupted_G: np.ndarray
    env_GM: np.ndarray
    experts_GLlc: np.ndarray | None = None

    @classmethod
    def of_rows(cls, r: Request, rows: list[dict], P: int) -> "Completed":
        """Request `r`'s completion from its G samples' engine rows as the generator fetched
        them (each field [M], `experts` [C, l, c]); P its prompt bucket."""

        def stack(k):
            return np.stack([row[k] for row in rows])

        lengths, tokens = stack("lengths"), stack("tokens")
        M = tokens.shape[1]
        return cls(
            request=r,
            tokens_GM=tokens,
            mask_GM=np.arange(M)[None, :] < lengths[:, None],
            logprobs_GM=stack("logprobs"),
            versions_GM=stack("versions"),
            forced_GM=stack("forced"),
            lengths_G=lengths,
            truncated_G=~stack("stopped"),
            interrupted_G=stack("interrupted"),
            env_GM=stack("env"),
            # The row's columns: its prompt bucket and M.
            experts_GLlc=stack("experts")[:, : P + M] if "experts" in rows[0] else None,
        )


class Turn(NamedTuple):
    """A sample stopped at an action stop (`SamplingConfig.action_stops`): it waits for the
    environment's reply and decodes nothing meanwhile, in its slot or, when a queued request
    or a replied sample needs the slot, in a parking row (`Generator(parked=...)`).

    Attributes:
      handle: names the turn to `Generator.reply` (unique among the turns that wait).
      request: the request the sample belongs to.
      sample: which of the request's G samples (g).
      tokens: the turn's tokens as sampled, from the end of the previous reply (or the start
        of the completion) to the action stop, included.
      room: tokens left in the sample's budget: a longer reply is cut to this many, and the
        sample then finishes (truncated).
    """

    handle: int
    request: Request
    sample: int
    tokens: np.ndarray
    room: int


class Stepped(NamedTuple):
    """What `Generator.step` returns: the requests whose samples are all done, and the
    samples that stopped at an action in this step."""

    completed: list[Completed]
    waiting: list[Turn]


@dataclasses.dataclass
class EngineStats:
    """Counters since the engine started: decode steps run, slot-steps (steps x slots),
    tokens generated (the useful slot-steps), environment tokens appended, samples parked
    and brought back, seconds decoding, prefilling, appending replies, moving parked samples
    and swapping weights (device busy time: each call is waited on); and the engine's
    parking rows (a constant). The KV cache's use, sampled after each decode call and
    weighted by its steps: `live_tokens` the unfinished samples' tokens (prompt and
    completion), `kv_columns` the cache columns held (dense: every slot's row; paged: the
    blocks taken); `kv_blocks_peak` the most blocks taken at once (paged); `prefills` the
    prefill calls and `prefill_rows` their rows that place samples (a request per shard it
    reaches); with `kv_preempt`, the samples preempted and resumed, and the seconds doing it
    (their keys and values to the host and back)."""

    steps: int = 0
    slot_steps: int = 0
    tokens: int = 0
    env_tokens: int = 0
    parked: int = 0
    unparked: int = 0
    decode_s: float = 0.0
    prefill_s: float = 0.0
    reply_s: float = 0.0
    move_s: float = 0.0
    swap_s: float = 0.0
    parking_rows: int = 0
    live_tokens: int = 0
    kv_columns: int = 0
    kv_blocks_peak: int = 0
    prefills: int = 0
    prefill_rows: int = 0
    preempted: int = 0
    resumed: int = 0
    preempt_s: float = 0.0

    @property
    def utilization(self) -> float:
        return self.tokens / max(self.slot_steps, 1)
