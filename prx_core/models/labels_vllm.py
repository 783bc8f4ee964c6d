"""The `llm` labeller's `vllm` transport: a whole Ray Data stage through `ray.data.llm`.

Mirrors prx_core.models.captioning_vllm (whose processor config and row finalizing it shares): captions
in, label rows (LABEL_COLUMNS, with `error`) out, the same columns `LabelBatch` yields for the
HTTP transport, so prx_core.stages.labels.build_labels stores them the same way. The instruction,
the strict parser and the version are prx_core.models.labels_llm's. Building the processor needs Ray and
transformers, not vLLM, which is imported only inside the engine actors on the GPU workers.

Per row: preprocess builds [system instruction, caption] and sampling params constrained to the
three labels; Ray's ChatTemplate stage applies the model's template with chat_template_kwargs
{"enable_thinking": ...} (Ray 2.60 takes them from the stage config, not per row), then Tokenize,
vLLMEngine (GPU), Detokenize; postprocess parses `generated_text` strictly. A row the engine
failed (`should_continue_on_error`) bypasses postprocess inside Ray and `FinalizeRows` turns it
into a `generation_error` row, retried on the next materialization.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prx_core.models import captioning_vllm
from prx_core.models.label_base import LABELS, LabelerConfig
from prx_core.models.labels_llm import (
    blank_result,
    build_messages,
    chat_template_kwargs,
    failure,
    is_blank,
    result_from_answer,
)

LABEL_COLUMNS = ("content_id", "label", "score", "labeler_id", "labeler_version", "error")
RowFn = Callable[[Mapping[str, Any]], dict[str, Any]]


def vllm_preprocess(config: LabelerConfig) -> RowFn:
    """Row -> request for `ray.data.llm.build_processor(..., preprocess=...)`: messages and
    sampling params constrained to the labels (`structured_outputs`, what Ray 2.60's engine stage
    turns into vLLM StructuredOutputsParams; the answer is still parsed strictly by
    `vllm_postprocess`). Rows carry `content_id` and `caption`."""
    temperature, max_tokens = float(config.temperature), int(config.max_tokens)

    def preprocess(row: Mapping[str, Any]) -> dict[str, Any]:
        caption = "" if row.get("caption") is None else str(row["caption"])
        return {
            "content_id": row["content_id"],
            "caption": caption,
            "messages": build_messages(caption),
            "sampling_params": {"temperature": temperature, "max_tokens": max_tokens,
                                "structured_outputs": {"choice": list(LABELS)}},
            **captioning_vllm.carried(row),
        }

    return preprocess


def vllm_postprocess(config: LabelerConfig) -> RowFn:
    """Processor output row (`generated_text`, carried `content_id`/`caption`) -> label row
    (LABEL_COLUMNS). Blank captions (sent anyway by the processor) become visual with score 0,
    as in the HTTP path; a row the engine failed becomes `generation_error`."""
    labeler_id, labeler_version = config.labeler_id(), config.version()

    def postprocess(row: Mapping[str, Any]) -> dict[str, Any]:
        if is_blank(row.get("caption")):
            result = blank_result()
        elif row.get(captioning_vllm.INFERENCE_ERROR):
            result = failure("generation_error", str(row[captioning_vllm.INFERENCE_ERROR])[:120])
        elif row.get("generated_text") is None:
            result = failure("bad_response", "no generated_text")
        else:
            result = result_from_answer(row["generated_text"])
        return {"content_id": row["content_id"], "label": result.label, "score": float(result.score),
                "labeler_id": labeler_id, "labeler_version": labeler_version, "error": result.error or "",
                **captioning_vllm.carried(row)}

    return postprocess


def build_vllm_processor_config(config: LabelerConfig) -> Any:
    """The `vLLMEngineProcessorConfig`: text only, chat_template_kwargs on the ChatTemplateStage."""
    if config.backend != "llm" or config.transport != "vllm":
        raise ValueError("build_vllm_processor_config needs the llm labeler with transport vllm")
    template_kwargs = chat_template_kwargs(config)
    stage = True if template_kwargs is None else {"enabled": True, "chat_template_kwargs": template_kwargs}
    return captioning_vllm.processor_config(config, captioning_vllm.base_engine_kwargs(config), chat_template_stage=stage)


def build_vllm_processor(config: LabelerConfig) -> Any:
    """`ray.data.llm.build_processor` for labelling (a Processor: Dataset -> Dataset)."""
    from ray.data.llm import build_processor

    return build_processor(build_vllm_processor_config(config), preprocess=vllm_preprocess(config),
                           postprocess=vllm_postprocess(config))


def label_dataset(dataset: Any, config: LabelerConfig, carry: Sequence[str] = ()) -> Any:
    """Rows (content_id, caption) -> label rows (LABEL_COLUMNS, with `error`), through vLLM; the
    `carry` columns come out as they went in."""
    processor = build_vllm_processor(config)
    finalize = captioning_vllm.FinalizeRows(vllm_postprocess(config), LABEL_COLUMNS, "label")
    return processor(dataset.select_columns(["content_id", "caption", *carry])).map(finalize)
