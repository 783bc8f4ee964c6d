"""The `transformers` captioner: a local Hugging Face VLM checkpoint (Qwen-VL family) on the CPU
or a single GPU, for tests, the demo and small runs; production uses vLLM
(`prx_core.models.captioning_vllm`). Imported only when this backend is built: it loads torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from PIL import Image

from prx_core.models.caption_base import (
    GENERATION_ERROR,
    MIN_MAX_PIXELS,
    Captioner,
    CaptionerConfig,
    CaptionResult,
    check_lengths,
    generated_caption,
    prepare_image,
)
from prx_core.models.caption_checks import LENGTH, STOP
from prx_core.models.prompts import CAPTION_PROMPT


class TransformersCaptioner(Captioner):
    """A local Qwen-VL checkpoint with transformers, for tests, the demo and small CPU runs
    (production uses vLLM on GPUs)."""

    def __init__(self, config: CaptionerConfig, model: Any = None, processor: Any = None) -> None:
        """Loads `config.model` (a local checkpoint, in `config.dtype`), unless a built `model` and its
        `processor` are given (benchmarks: a randomly initialised architecture on a GPU)."""
        super().__init__(config)
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor, GenerationConfig

        path = Path(config.model)
        self.processor = processor or AutoProcessor.from_pretrained(path, local_files_only=True)
        self.processor.tokenizer.padding_side = "left"  # batched generation appends on the right
        cap_image_processor(self.processor.image_processor, config.max_pixels)
        if model is None:
            model = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True,
                                                                dtype=getattr(torch, config.dtype))
        self.model = model.eval()
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": CAPTION_PROMPT}]}]
        self.prompt = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # Decoding is defined by the config alone; the checkpoint contributes only its stop ids
        # (its own generation_config.json may carry top_k / repetition penalties we do not want).
        stock, tokenizer = model.generation_config, self.processor.tokenizer
        eos = stock.eos_token_id if stock.eos_token_id is not None else tokenizer.eos_token_id
        pad = stock.pad_token_id if stock.pad_token_id is not None else tokenizer.pad_token_id
        self.eos = [eos] if isinstance(eos, int) else list(eos or [])
        pad = pad if pad is not None else (self.eos[0] if self.eos else None)
        self.generation_config = decoding(GenerationConfig, config, self.eos, pad)
        self.fallback_config = decoding(GenerationConfig, config, self.eos, pad, fallback=True)

    def caption_batch(self, images: Sequence[bytes], original_captions: Sequence[str | None],
                      fallback: bool = False) -> list[CaptionResult]:
        check_lengths(images, original_captions)
        results: list[CaptionResult] = []
        size = self.config.batch_size
        for start in range(0, len(images), size):
            chunk = [prepare_image(data, self.config.max_pixels) for data in images[start : start + size]]
            ready = [(i, item) for i, item in enumerate(chunk) if isinstance(item, Image.Image)]
            captions = dict(zip((i for i, _ in ready), self.caption_images([image for _, image in ready], fallback)))
            results.extend(item if isinstance(item, CaptionResult) else captions[i] for i, item in enumerate(chunk))
        return results

    def caption_images(self, images: list[Image.Image], fallback: bool = False) -> list[CaptionResult]:
        """Generate for decoded images together; if the batch fails, isolate the bad image(s)."""
        if not images:
            return []
        try:
            texts, counts, finished = self.generate(images, fallback)
        except Exception as exc:
            if len(images) == 1:
                return [CaptionResult.failed(GENERATION_ERROR, f"{type(exc).__name__}: {exc}")]
            return [result for image in images for result in self.caption_images([image], fallback)]
        return [generated_caption(text, self.config.max_caption_chars, count, finish_reason=reason)
                for text, count, reason in zip(texts, counts, finished)]

    def generate(self, images: list[Image.Image], fallback: bool = False) -> tuple[list[str], list[int], list[str]]:
        """Captions, the number of tokens generated for each (padding excluded) and why each
        stopped: "stop" at an end-of-sequence token, else "length" (only the token cap stops
        generation otherwise)."""
        import torch

        inputs = self.processor(images=images, text=[self.prompt] * len(images), padding=True, return_tensors="pt")
        inputs = inputs.to(self.model.device)
        config = self.fallback_config if fallback else self.generation_config
        with torch.inference_mode():
            if fallback and config.do_sample:
                torch.manual_seed(0)  # a sampled retry is reproducible
            output = self.model.generate(**inputs, generation_config=config)
        new_tokens = output[:, inputs["input_ids"].shape[1]:]
        pad = config.pad_token_id
        counts = [int(n) for n in (new_tokens != pad).sum(dim=1)] if pad is not None else [new_tokens.shape[1]] * len(images)
        stopped = torch.isin(new_tokens, torch.tensor(self.eos, device=new_tokens.device)).any(dim=1).tolist()
        finished = [STOP if hit else LENGTH for hit in stopped]
        return [text.strip() for text in self.processor.batch_decode(new_tokens, skip_special_tokens=True)], counts, finished


def decoding(generation_config: Any, config: CaptionerConfig, eos: list[int], pad: int | None,
             fallback: bool = False) -> Any:
    """The GenerationConfig of the config's decoding, or of its fallback (the retry of a refused caption)."""
    temperature, penalty = config.decoding(fallback)
    sampled = temperature > 0
    return generation_config(
        max_new_tokens=config.max_new_tokens, do_sample=sampled, num_beams=1,
        temperature=temperature if sampled else None, top_p=config.top_p if sampled else None,
        top_k=None, eos_token_id=eos, pad_token_id=pad, repetition_penalty=penalty,
    )


def cap_image_processor(image_processor: Any, max_pixels: int) -> None:
    """Make the processor's own resize respect the cap (it rounds sides to multiples of 28)."""
    low = min(image_processor.size.get("shortest_edge", MIN_MAX_PIXELS), max_pixels)
    image_processor.size = {"shortest_edge": low, "longest_edge": max_pixels}  # a fresh dict, never mutate
    image_processor.min_pixels, image_processor.max_pixels = low, max_pixels
