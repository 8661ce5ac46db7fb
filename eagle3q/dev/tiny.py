"""A tiny target built locally: a byte-level BPE tokenizer (with every profile's special tokens) and a small Llama.

Used by the demo, the tests and the benchmarks, where no model can be downloaded. The tokenizer part needs only the
`tokenizers` library; the model part needs torch + transformers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from eagle3q.generate.profiles import ALL_SPECIAL_TOKENS, PROFILES
from eagle3q.sim.textgen import _FILLER

DATA_DIR = Path(__file__).parents[1] / "data"  # eagle3q/data: shipped with the package
SAMPLE_DATASET = DATA_DIR / "perfectblend_sample.jsonl"


def _corpus() -> Iterator[str]:
    for line in SAMPLE_DATASET.read_text().splitlines():
        for turn in json.loads(line)["conversations"]:
            yield turn["value"].lower()
            yield turn["value"]
    yield " ".join(_FILLER)
    yield "user assistant system"


def build_tokenizer(out_dir: Path, vocab_size: int = 1024) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    end_tokens = tuple(dict.fromkeys(p.end_of_turn for p in PROFILES.values()))
    specials = list(dict.fromkeys(("<unk>", *ALL_SPECIAL_TOKENS, *end_tokens)))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "<unk>",
                "eos_token": "<|im_end|>",
                "model_max_length": 4096,
            }
        )
    )
    return out_dir


# vLLM's CPU attention serves head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224 and 256 only (a head of 16 kills
# the engine on its first request): two heads of 32 (one KV head, grouped as in real targets) keep the tiny target
# servable by the real engine (tests/engine) at the same hidden size.
TINY_HEADS, TINY_KV_HEADS = 2, 1


def build_model(out_dir: Path, layers: int = 8, hidden: int = 64, seed: int = 0) -> Path:
    """A random-weight Llama over the tiny tokenizer (built first when missing). Deterministic for a seed. Its head
    size (hidden / 2 = 32 by default) is one vLLM's CPU backend serves."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if not (out_dir / "tokenizer.json").is_file():
        build_tokenizer(out_dir)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(out_dir / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=TINY_HEADS,
        num_key_value_heads=TINY_KV_HEADS,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        eos_token_id=Tokenizer.from_file(str(out_dir / "tokenizer.json")).token_to_id("<|im_end|>"),
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        # Larger-than-default weights give the random target confident, structured predictions (a near-uniform
        # next-token distribution would make every draft look equally bad).
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.6 if name.startswith("lm_head") else 0.08)
        # A final norm whose weight is not 1, as in real targets: a state normalised twice (or never) then gives
        # other logits, so the tests see which side of the norm a stored state is on.
        model.model.norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def is_built(out_dir: Path, layers: int = 8, hidden: int = 64, tokenizer_only: bool = False) -> bool:
    """`out_dir` already holds what `build_model` makes with these settings (the tokenizer alone when
    `tokenizer_only`): its config's shape and head count, the weights written."""
    if not (out_dir / "tokenizer.json").is_file():
        return False
    if tokenizer_only:
        return True
    cfg_path = out_dir / "config.json"
    if not (out_dir / "model.safetensors").is_file() or not cfg_path.is_file():
        return False
    cfg = json.loads(cfg_path.read_text())
    return (cfg.get("num_hidden_layers"), cfg.get("hidden_size"), cfg.get("num_attention_heads")) == (
        layers, hidden, TINY_HEADS)


# Jinja chat templates of the supported families, rendering the generation prompt the way the real models' templates
# do (the parts that decide the token stream: role tags, end-of-turn, the reasoning prefill and its switch). They are
# what vLLM's own server applies to the tiny target in tests/conformance; `eagle3q.generate.templates.render_prompt`
# must render the same text (tested).
CHAT_TEMPLATES: dict[str, str] = {
    # Kimi-K2.5: thinking on pre-fills <think>, off pre-fills <think></think> (switch: `thinking`).
    "kimi_k2": (
        "{%- for m in messages -%}"
        "{%- if m.role == 'system' -%}<|im_system|>system<|im_middle|>{{ m.content }}<|im_end|>"
        "{%- elif m.role == 'user' -%}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>"
        "{%- else -%}<|im_assistant|>assistant<|im_middle|>{{ m.content }}<|im_end|>{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
        "{%- if thinking is defined and not thinking -%}<think></think>{%- else -%}<think>{%- endif -%}"
        "{%- endif -%}"
    ),
    # Kimi-K2-Thinking: the same turns, and no prefill: the model opens <think> itself.
    "kimi_k2_thinking": (
        "{%- for m in messages -%}"
        "{%- if m.role == 'system' -%}<|im_system|>system<|im_middle|>{{ m.content }}<|im_end|>"
        "{%- elif m.role == 'user' -%}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>"
        "{%- else -%}<|im_assistant|>assistant<|im_middle|>{{ m.content }}<|im_end|>{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    ),
    # Qwen3: the model opens <think>; thinking off pre-fills an empty block (switch: `enable_thinking`).
    "qwen3": (
        "{%- for m in messages -%}<|im_start|>{{ m.role }}{{ '\\n' }}{{ m.content }}<|im_end|>{{ '\\n' }}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|im_start|>assistant{{ '\\n' }}"
        "{%- if enable_thinking is defined and not enable_thinking -%}<think>{{ '\\n\\n' }}</think>{{ '\\n\\n' }}"
        "{%- endif -%}{%- endif -%}"
    ),
    # DeepSeek-R1 (updated template): "<think>\n" forced into the generation prompt; no switch.
    "deepseek_r1": (
        "<｜begin▁of▁sentence｜>"
        "{%- for m in messages -%}"
        "{%- if m.role == 'system' -%}{{ m.content }}"
        "{%- elif m.role == 'user' -%}<｜User｜>{{ m.content }}"
        "{%- else -%}<｜Assistant｜>{{ m.content }}<｜end▁of▁sentence｜>{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}<｜Assistant｜><think>{{ '\\n' }}{%- endif -%}"
    ),
}


def build_served_model(tiny_dir: Path, out_dir: Path, template: str, extra_eos: tuple[str, ...] = ()) -> Path:
    """The tiny target as a served model directory of one family: its weights and tokenizer, the family's chat
    template and end-of-turn token as the tokenizer's eos (what vLLM stops on). `extra_eos`: more stop tokens in
    generation_config.json, as real models list them (Qwen3: `<|im_end|>` and `<|endoftext|>`); vLLM reports the
    one that stopped a generation in `stop_reason`."""
    from tokenizers import Tokenizer

    profile = PROFILES["kimi_k2" if template == "kimi_k2_thinking" else template]
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "tokenizer.json"):
        target = out_dir / name
        if not target.exists():
            target.symlink_to((tiny_dir / name).resolve())
    eos_id = Tokenizer.from_file(str(tiny_dir / "tokenizer.json")).token_to_id(profile.end_of_turn)
    config = json.loads((tiny_dir / "config.json").read_text())
    config["eos_token_id"] = eos_id
    (out_dir / "config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    eos: int | list[int] = [eos_id, *(tok.token_to_id(t) for t in extra_eos)] if extra_eos else eos_id
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    tok_cfg = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    tok_cfg.update(eos_token=profile.end_of_turn, chat_template=CHAT_TEMPLATES[template])
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return out_dir
