"""`llm` label backend: a text LLM reads the caption and answers exactly one of visual / text / nsfw.

Two transports (`LabelerConfig.transport`) share one instruction, one request and one strict parser:
  * `openai`: `OpenAILLMLabeler`, any OpenAI-compatible chat completions endpoint (`vllm serve`,
    hosted) through the shared `prx_core.models.openai_http.ChatClient` (bounded concurrency, per-request
    timeout, retries with backoff and Retry-After on 408/409/429/5xx, timeouts, connection errors).
  * `vllm`: a whole Ray Data stage through `ray.data.llm.build_processor`: prx_core.models.labels_vllm
    (as prx_core.models.captioning_vllm is for captions); vLLM runs in the Ray GPU workers only.

The instruction is the system message; the caption is the user message, verbatim. The request
asks for temperature 0 and a few tokens, and optionally constrains the output (`constrained`:
OpenAI `response_format` json_schema with an enum; vLLM's choice among the three labels as
`structured_outputs` {"choice": [...]} (vLLM >= 0.10.2), or as the legacy top-level `guided_choice`
for servers older than 0.12, which removed it and silently ignores it; the vllm transport is
always constrained to the three labels). Qwen3 thinks before answering unless told not to:
`thinking` (default False) is sent as chat_template_kwargs {"enable_thinking": ...}, a top-level
body field for `vllm serve`, the ChatTemplateStage's kwargs for the processor (Ray 2.60 reads
them there, not per row). Whatever the server promises, the answer is validated by `parse_label`:
one leading `<think>...</think>` block is dropped, then, after stripping whitespace, quotes and one
trailing period and lowercasing, it must be exactly one label, or a JSON object whose only key is
"label" with exactly one label as its string value. Anything else (two labels, explanations,
echoes of injected instructions, lookalike characters, empty) is an `unparseable` failure.

A failure is a `LabelResult` with label "" and `error` = "<code>: <detail>", codes:
`unparseable`, `http_<status>` (after retries for retryable statuses), `timeout`, `connection`,
`bad_response` (a 200 whose body is not a chat completion, however odd: parsing never raises),
`response_too_large` (a body over `max_response_bytes`), `generation_error` (the vLLM engine
failed the row). The stage stores no row for it, so the next materialization retries it. A blank
caption needs no model: visual, score 0 (as minilm). A label's score is 1.0 (no calibrated score).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from prx_core.models.label_base import LABELS, Labeler, LabelerConfig, LabelResult
from prx_core.models.openai_http import BAD_SHAPE, HTTP, TIMEOUT, TOO_LARGE, ChatClient, Post, Reply, parse_chat
from prx_core.models.prompts import LABEL_INSTRUCTION

MAX_ANSWER_CHARS = 200  # a valid answer is a word or {"label": "..."}; longer is unparseable as is
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_QUOTES = " \t\r\n\"'`\u201c\u201d\u2018\u2019"

JSON_SCHEMA = {
    "type": "object",
    "properties": {"label": {"type": "string", "enum": list(LABELS)}},
    "required": ["label"],
    "additionalProperties": False,
}


# --------------------------------------------------------------------------- parsing


def _normalize(text: str) -> str:
    s = text.strip(_QUOTES)
    if s.endswith("."):
        s = s[:-1]
    return s.strip(_QUOTES).lower()


def strip_think(answer: str) -> str | None:
    """The answer after one leading `<think>...</think>` block (Qwen3's reasoning, empty or not),
    unchanged without one; None for an unclosed or nested block."""
    s = answer.lstrip()
    if not s.startswith(THINK_OPEN):
        return answer
    end = s.find(THINK_CLOSE)
    if end < 0 or THINK_OPEN in s[len(THINK_OPEN):end]:
        return None
    return s[end + len(THINK_CLOSE):]


def parse_label(answer: object) -> str | None:
    """The label of a model answer, or None if it is not exactly one label (see module doc)."""
    if not isinstance(answer, str):
        return None
    answer = strip_think(answer)
    if answer is None or len(answer) > MAX_ANSWER_CHARS:
        return None
    s = answer.strip()
    if s.startswith("{"):
        try:
            obj = json.loads(s)
        except (ValueError, RecursionError):
            return None
        if not isinstance(obj, dict) or set(obj) != {"label"} or not isinstance(obj["label"], str):
            return None
        s = obj["label"]
        if s != s.strip():
            return None
        s = s.lower()
    else:
        s = _normalize(s)
    return s if s in LABELS else None


def result_from_answer(answer: object) -> LabelResult:
    """The label of any answer, or an `unparseable` failure quoting it (a non-string by its type:
    its repr could be huge or nested deeper than repr allows)."""
    label = parse_label(answer)
    if label is None:
        return failure("unparseable", repr(answer[:200])[:120] if isinstance(answer, str) else type(answer).__name__)
    return LabelResult(label, 1.0, {name: float(name == label) for name in LABELS})


def failure(code: str, detail: str = "") -> LabelResult:
    return LabelResult("", 0.0, {}, error=f"{code}: {detail}" if detail else code)


def blank_result() -> LabelResult:
    return LabelResult("visual", 0.0, {label: 0.0 for label in LABELS})


def is_blank(caption: object) -> bool:
    return caption is None or not str(caption).strip()


def error_code(error: str) -> str:
    """`http_429: ...` -> `http_429` (the reason counted in reports)."""
    return error.split(":", 1)[0]


# --------------------------------------------------------------------------- requests


def build_messages(caption: str) -> list[dict[str, str]]:
    """Instruction as the system message, the caption verbatim as the user message."""
    return [{"role": "system", "content": LABEL_INSTRUCTION}, {"role": "user", "content": caption}]


def chat_template_kwargs(config: LabelerConfig) -> dict[str, bool] | None:
    """{"enable_thinking": config.thinking}; None (send nothing) when `thinking` is None."""
    return None if config.thinking is None else {"enable_thinking": config.thinking}


def build_chat_request(config: LabelerConfig, caption: str) -> dict[str, Any]:
    """The OpenAI chat completions body for one caption."""
    body: dict[str, Any] = {
        "model": config.model,
        "messages": build_messages(caption),
        "temperature": float(config.temperature),
        "max_tokens": int(config.max_tokens),
    }
    if config.constrained == "json_schema":
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "caption_label", "strict": True, "schema": JSON_SCHEMA}}
    elif config.constrained == "structured_outputs":
        body["structured_outputs"] = {"choice": list(LABELS)}  # vLLM extra body
    elif config.constrained == "guided_choice":
        body["guided_choice"] = list(LABELS)  # vLLM < 0.12 extra body
    template_kwargs = chat_template_kwargs(config)
    if template_kwargs is not None:
        body["chat_template_kwargs"] = template_kwargs  # vLLM extra body (Qwen3: no <think> block)
    return body


# --------------------------------------------------------------------------- HTTP transport


class OpenAILLMLabeler(Labeler):
    """Labels through an OpenAI-compatible `/chat/completions` endpoint (prx_core.models.openai_http)."""

    may_fail = True

    def __init__(self, config: LabelerConfig) -> None:
        super().__init__(config)
        if config.transport == "vllm":
            raise ValueError("the llm labeler with transport vllm runs as a whole Ray Data stage "
                             "(prx_core.models.labels_vllm.label_dataset, used by prx_core.stages.labels), not per batch")
        if not config.endpoint.strip():
            raise ValueError("the llm labeler over HTTP needs `endpoint` (an OpenAI-compatible base URL)")
        self.client = ChatClient(config)

    def label_batch(self, captions: Sequence[str]) -> list[LabelResult]:
        return self.client.gather(["" if c is None else str(c) for c in captions], self._label_one)

    async def _label_one(self, caption: str, post: Post) -> LabelResult:
        if is_blank(caption):
            return blank_result()
        return label_from_reply(await post(build_chat_request(self.config, caption)), self.config.timeout_s)


def label_from_reply(reply: Reply, timeout_s: float) -> LabelResult:
    """How one request ended as a label or a failure with its code; never raises, whatever the
    server sent (`parse_chat` reduces every odd body to BadResponse, `parse_label` takes any value)."""
    if reply.text is None:
        return http_failure(reply, timeout_s)
    try:
        answer, _ = parse_chat(reply.text)
    except BAD_SHAPE as exc:
        return failure("bad_response", str(exc)[:120])
    return result_from_answer(answer)


def http_failure(reply: Reply, timeout_s: float) -> LabelResult:
    """A failed `Reply` as this backend's error: `http_<status>`, `timeout` or `connection`."""
    if reply.failure == HTTP:
        return failure(f"http_{reply.status}", reply.detail[:120])
    if reply.failure == TIMEOUT:
        return failure("timeout", f"{timeout_s}s")
    if reply.failure == TOO_LARGE:
        return failure("response_too_large", reply.detail[:120])
    return failure("connection", reply.detail[:120])
