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


def build_model(out_dir: Path, layers: int = 8, hidden: int = 64, seed: int = 0) -> Path:
    """A random-weight Llama over the tiny tokenizer (built first when missing). Deterministic for a seed."""
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
        num_attention_heads=4,
        num_key_value_heads=2,
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
