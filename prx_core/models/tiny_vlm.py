"""A tiny, randomly initialised Qwen2-VL checkpoint built locally, for CPU tests and the demo.

No model weights may be downloaded on development machines, yet the transformers captioner
must be exercised end to end (processor, chat template, vision tower, batched generation).
This builds the smallest checkpoint that goes through exactly the same code path as a real
Qwen2-VL: a byte-level BPE tokenizer trained on the fly and wrapped as `Qwen2TokenizerFast`
with the chat special tokens, a fast image processor with a small pixel cap, the video
processor `Qwen2VLProcessor` insists on, and a 2-layer, hidden-128 model.
Its captions are gibberish by design; only their mechanics are meaningful.

vLLM loads the same folder as a real checkpoint (the vLLM tests, prx_core.models.vllm_cpu): its
config.json names the architecture (without `architectures` vLLM resolves the bare Qwen2VLModel
and a pooling runner), the text heads are 64 wide (vLLM's CPU attention refuses 16; text hidden
128 over 2 heads), the mrope sections sum to half of that, and the vision merger outputs the text
width. Builder 1 (hidden 64 over 4 heads) generated other tokens from the same seed: the weights
are drawn for other shapes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

BUILDER_VERSION = 2  # 2: shapes vLLM can load (hidden 128, 2 heads of 64), architectures named
MARKER = ".prx_tiny_vlm.json"  # written last: its presence means the checkpoint is complete
TINY_MAX_PIXELS = 112 * 112
TINY_MIN_PIXELS = 28 * 28

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)

# The Qwen2-VL-Instruct chat template (as published with the checkpoint), without tools.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS = (
    "a the of and in on with at left right top bottom centre center foreground background red "
    "green blue yellow white black grey gray brown orange pink purple wooden metal glass stone "
    "fabric plastic paper person people man woman child dog cat tree sky water road building "
    "window door table chair car street light shadow text sign logo overlay reads written photo "
    "illustration screenshot document small large round square bright dark sits stands holds "
    "behind next to above below near front side corner edge surface wall floor grass cloud"
)


def tokenizer_corpus() -> list[str]:
    """Training text for the BPE: the caption prompt plus a small English word list."""
    from prx_core.models.prompts import CAPTION_PROMPT

    return [CAPTION_PROMPT, _WORDS, _WORDS.title(), _WORDS.upper(), "0123456789 .,;:!?\"'()-"]


def train_tokenizer(vocab_size: int = 512):
    """A byte-level BPE wrapped as `Qwen2TokenizerFast` with the Qwen2-VL special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    bpe.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    return Qwen2TokenizerFast(
        tokenizer_object=bpe, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token=None, additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        model_max_length=4096, padding_side="left",
    )


def build_processor(tokenizer):
    from transformers import Qwen2VLImageProcessorFast, Qwen2VLProcessor, Qwen2VLVideoProcessor

    # Always pass a fresh `size` dict: passing min_pixels/max_pixels instead mutates the
    # class-level default `size` of these processors for the whole process (transformers 4.57).
    size = {"shortest_edge": TINY_MIN_PIXELS, "longest_edge": TINY_MAX_PIXELS}
    image_processor = Qwen2VLImageProcessorFast(size=dict(size))
    video_processor = Qwen2VLVideoProcessor(size=dict(size))
    return Qwen2VLProcessor(
        image_processor=image_processor, tokenizer=tokenizer,
        video_processor=video_processor, chat_template=CHAT_TEMPLATE,
    )


def build_model(tokenizer, seed: int):
    """2 text layers of width 128 (2 heads of 64) and a 2-block vision tower of width 32 merged to 128, random weights."""
    import torch
    from transformers import GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": 128, "intermediate_size": 256,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
            "max_position_embeddings": 4096, "max_window_layers": 2, "tie_word_embeddings": False,
            "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},  # sums to head_dim / 2 (Qwen2-VL's ratios)
            "bos_token_id": None, "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"],
            "initializer_range": 0.05,  # at the default 0.02 three real photos got one caption at this width
        },
        vision_config={
            "depth": 2, "embed_dim": 32, "hidden_size": 128, "num_heads": 2, "mlp_ratio": 2,  # hidden: the merger's output
            "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "initializer_range": 0.05,
        },
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        architectures=["Qwen2VLForConditionalGeneration"],  # what vLLM resolves its model class by
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        # Random weights would sometimes pick a special token (EOS) first and yield an empty
        # caption; making special tokens unreachable keeps every generation non-empty text.
        model.get_output_embeddings().weight[sorted(ids.values())] = 0.0
    model.generation_config = GenerationConfig(
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]], pad_token_id=ids["<|endoftext|>"],
        do_sample=False,
    )
    return model


def is_complete(path: Path, seed: int) -> bool:
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker == {"builder": BUILDER_VERSION, "seed": seed}


def build_tiny_qwen2_vl(path: str | Path, seed: int = 0) -> Path:
    """Build (or reuse) the tiny checkpoint at `path`; the same seed gives the same files.

    Built in a sibling temporary folder and renamed into place, so a concurrent builder or an
    interrupted build never leaves a half-written checkpoint that looks complete.
    """
    path = Path(path)
    if is_complete(path, seed):
        return path
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path} exists and is not a complete tiny checkpoint for seed {seed}")
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        tokenizer = train_tokenizer()
        build_processor(tokenizer).save_pretrained(staging)
        build_model(tokenizer, seed).save_pretrained(staging)
        (staging / MARKER).write_text(json.dumps({"builder": BUILDER_VERSION, "seed": seed}))
        if path.exists():
            path.rmdir()  # empty, checked above
        os.replace(staging, path)
    except OSError:
        if not is_complete(path, seed):  # lost a race only if the winner left a complete build
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path
