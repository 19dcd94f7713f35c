"""Request bodies SGLang accepts, as msgspec structs (decode = validation).

``SamplingParams`` forbids unknown fields because SGLang 0.5.23 answers 400 for them;
older versions ignore them (``strict_sampling`` off).
"""

from __future__ import annotations

from typing import Any

import msgspec


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    n: int = 1
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    custom_params: dict[str, Any] | None = None

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


def parse_sampling(raw: Any, strict: bool) -> SamplingParams:
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, dict):
        raise msgspec.ValidationError("sampling_params must be an object")
    if not strict:
        known = SamplingParams.__struct_fields__
        raw = {k: v for k, v in raw.items() if k in known}
    return msgspec.convert(raw, SamplingParams)


class GenerateReqInput(msgspec.Struct, omit_defaults=True):
    text: str | list[str] | None = None
    input_ids: list[Any] | None = None  # flat ids or a batch of id lists (checked in Engine)
    input_embeds: Any = None
    image_data: Any = None
    audio_data: Any = None
    video_data: Any = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: Any = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    log_metrics: bool = True
    return_hidden_states: Any = False
    modalities: Any = None
    lora_path: Any = None
    lora_id: Any = None
    session_params: Any = None
    custom_logit_processor: Any = None
    bootstrap_host: str | list[str | None] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int | None] | None = None
    bootstrap_pair_key: Any = None
    data_parallel_rank: int | None = None
    routed_dp_rank: int | None = None
    priority: int | None = None
    extra_key: str | list[str] | None = None
    cache_salt: str | list[str] | None = None
    custom_labels: dict[str, str] | None = None
    no_logs: bool = False
    return_bytes: bool = False
    return_entropy: bool = False
    background: bool = False
    conversation_id: Any = None
    label: Any = None
    is_single: Any = None
    validation_time: Any = None
    received_time: Any = None


def pick(value: Any, i: int) -> Any:
    """SGLang batch fields are a scalar (shared) or a list (one per request)."""
    if isinstance(value, list):
        return value[i] if i < len(value) else None
    return value
