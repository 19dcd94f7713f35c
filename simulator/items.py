"""What a simulated engine accepts: a ``/generate`` body expanded into ``Item``s (one per
sequence: a batch or n > 1 becomes several) and the checks SGLang answers with a 400."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from .profiles import Profile
from .protocol import GenerateReqInput, SamplingParams, parse_sampling, pick

_TOKEN_ID_LIMIT = 1 << 32


class ApiError(Exception):
    def __init__(self, status: int, message: str, err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type


def check_client_ids(prompts: list[list[int]]) -> None:
    """Token ids a client sent (a tokenizer's are in range by construction). SGLang leaves this
    to the model (an embedding lookup out of range); here one bad request must not take the
    simulated scheduler down with it: its page hashes pack ids as uint32."""
    for ids in prompts:
        if not all(isinstance(t, int) for t in ids):
            raise ApiError(400, "input_ids must be a list of ints or a list of lists of ints")
        if ids and not 0 <= min(ids) <= max(ids) < _TOKEN_ID_LIMIT:
            raise ApiError(400, f"input_ids must lie in [0, {_TOKEN_ID_LIMIT}): got {min(ids)}..{max(ids)}")


@dataclass(slots=True)
class Item:
    """One sequence to generate (a batch or n>1 request expands into several)."""

    index: int
    rid: str
    input_ids: list[int]
    params: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    cache_salt: str | None = None
    priority: int | None = None
    seed_offset: int = 0
    dp_rank: int | None = None  # routed_dp_rank (data_parallel_rank before 0.5.x renamed it)
    received: float = field(default_factory=time.monotonic)


def expand_generate(body: GenerateReqInput, encode: Callable[[str], list[int]], strict: bool
                    ) -> tuple[list[Item], bool]:
    """Expand a GenerateReqInput; returns (items, is_batch). ``strict``: unknown sampling
    fields are refused (SGLang 0.5.23 and later)."""
    if body.text is None and body.input_ids is None:
        raise ApiError(400, "Either text or input_ids should be provided.")
    if body.input_ids is not None:
        ids = body.input_ids
        batch = bool(ids) and isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        if not all(isinstance(p, list) for p in prompts):
            raise ApiError(400, "input_ids must be a list of ints or a list of lists of ints")
        check_client_ids(prompts)
    else:
        batch = isinstance(body.text, list)
        texts = body.text if batch else [body.text]
        prompts = [encode(t) for t in texts]
    items: list[Item] = []
    idx = 0
    for i, prompt in enumerate(prompts):
        try:
            params = parse_sampling(pick(body.sampling_params, i), strict)
        except msgspec.ValidationError as e:
            raise ApiError(400, _unknown_field_message(str(e))) from None
        n = max(params.n, 1)
        if n > 1:
            batch = True
        rid_v = pick(body.rid, i) if isinstance(body.rid, list) else body.rid
        for j in range(n):
            if isinstance(body.rid, list):
                rid = rid_v or uuid.uuid4().hex
                if n > 1:
                    rid = f"{rid}_{j}"
            elif body.rid is not None and (len(prompts) > 1 or n > 1):
                rid = f"{body.rid}_{idx}"
            else:
                rid = body.rid or uuid.uuid4().hex
            items.append(Item(
                index=idx, rid=rid, input_ids=list(prompt), params=params, stream=body.stream,
                return_logprob=bool(pick(body.return_logprob, i)),
                logprob_start_len=pick(body.logprob_start_len, i) if body.logprob_start_len is not None else -1,
                top_logprobs_num=max(pick(body.top_logprobs_num, i) or 0, 0),
                return_text_in_logprobs=body.return_text_in_logprobs,
                bootstrap_host=pick(body.bootstrap_host, idx), bootstrap_port=pick(body.bootstrap_port, idx),
                bootstrap_room=pick(body.bootstrap_room, idx), cache_salt=pick(body.cache_salt, i),
                priority=body.priority, seed_offset=j,
                dp_rank=body.routed_dp_rank if body.routed_dp_rank is not None else body.data_parallel_rank,
            ))
            idx += 1
    return items, batch


def check_item(item: Item, profile: Profile, ranks: int, disaggregated: bool) -> None:
    """SGLang's 400s for one sequence: empty, past the context or the KV pool, a DP rank out
    of range, a disaggregated worker's request without a bootstrap room."""
    if not item.input_ids:
        raise ApiError(400, "The input_ids is empty.")
    mx = item.params.max_new_tokens
    if mx is not None and mx < 0:
        raise ApiError(400, "max_new_tokens must be at least 0, got {}.".format(mx))
    total = len(item.input_ids) + (mx or 0)
    if len(item.input_ids) >= profile.context_length:
        raise ApiError(400, f"The input ({len(item.input_ids)} tokens) is longer than the model's context "
                            f"length ({profile.context_length} tokens).")
    if total > profile.max_total_num_tokens:
        raise ApiError(400, f"Requested {total} tokens exceed the KV pool ({profile.max_total_num_tokens}).")
    if item.dp_rank is not None and not 0 <= item.dp_rank < ranks:
        raise ApiError(400, f"routed_dp_rank {item.dp_rank} is out of range [0, {ranks})")
    if disaggregated and item.bootstrap_room is None:  # prefill and decode alike
        raise ApiError(400, "Disaggregated request received without bootstrap room id")


def _unknown_field_message(err: str) -> str:
    # msgspec: "Object contains unknown field `foo`" -> SGLang 0.5.23's wording
    if "unknown field" in err:
        name = err.split("`")[1] if "`" in err else err
        return f"unknown field `{name}` in sampling_params"
    return err
