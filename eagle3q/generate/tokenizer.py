"""A thin tokenizer interface over the `tokenizers` library (fast, no torch), with a transformers fallback for
tokenizers that need remote code (Kimi's TikToken tokenizer)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class TokenizerLike(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def token_to_id(self, token: str) -> int | None: ...
    def special_ids(self) -> set[int]: ...


class FastTokenizer:
    """`tokenizer.json` through the Rust `tokenizers` library: special tokens in text parse as single tokens."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def special_ids(self) -> set[int]:
        """The added tokens marked special: chat-template markers, <think>/</think>, end of turn."""
        return {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}


class HFTokenizer:
    """transformers' AutoTokenizer, for tokenizers without a tokenizer.json (e.g. Kimi's, trust_remote_code)."""

    def __init__(self, spec: str):
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(spec, trust_remote_code=True)
        self.vocab_size = len(self._tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        tid = self._tok.convert_tokens_to_ids(token)
        return None if tid is None or tid == self._tok.unk_token_id else int(tid)

    def special_ids(self) -> set[int]:
        added = {i for i, t in self._tok.added_tokens_decoder.items() if t.special}
        return added | set(self._tok.all_special_ids)


def load_tokenizer(spec: str) -> TokenizerLike:
    if not spec:
        raise ValueError("no tokenizer configured: set EAGLE3Q_TOKENIZER to the target's tokenizer (path or hub id)")
    path = Path(spec)
    if path.is_file() and path.suffix == ".json":
        return FastTokenizer(path)
    if (path / "tokenizer.json").is_file():
        return FastTokenizer(path / "tokenizer.json")
    if (path.is_absolute() or spec.startswith(".")) and not path.exists():
        raise FileNotFoundError(f"tokenizer {spec} does not exist (EAGLE3Q_TOKENIZER: a directory with "
                                "tokenizer.json, or a hub id)")
    try:
        import transformers  # noqa: F401
    except ModuleNotFoundError:
        raise ModuleNotFoundError(f"tokenizer {spec} has no tokenizer.json, and loading it through transformers "
                                  "(Kimi's TikToken tokenizer, a hub id) needs transformers and tiktoken: pip install "
                                  "'eagle3q[remote-tokenizer]'") from None
    return HFTokenizer(spec)
