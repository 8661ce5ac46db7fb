"""The simulator's `extract_hidden_states` mode: `/v1/completions` with token ids as the prompt answers like a vLLM
started with `--speculative-config '{"method": "extract_hidden_states", ...}'` and the
`ExampleHiddenStatesConnector`: one generated token, `prompt_token_ids`, and `kv_transfer_params.hidden_states_path`
naming a safetensors file (`token_ids` [T], `hidden_states` [T, n_layers, H] in bf16, the configured layer ids in
vLLM's convention, the last one L = the final state before the norm) written under an exclusive flock on
`<file>.lock`, computed with the tiny target on CPU."""

from __future__ import annotations

import fcntl
import os
import threading
import uuid
from pathlib import Path


class ConnectorWriter:
    """`layer_ids`' last id is the "final" column: L (the last layer's output before the norm) as a right server
    writes it; any other id plays a server that returns the wrong layer there (the deepseek_v2 family of bugs, or a
    misconfigured id list), which vLLM itself would also accept. `shift`: states moved by that many tokens against
    the token ids (a fault no shape check sees)."""

    def __init__(self, target_model: str, out_dir: str, layer_ids: list[int] | None, shift: int = 0):
        import torch

        from eagle3q.extraction.transformers_backend import TransformersExtractor, default_aux_ids
        from eagle3q.target import target_config

        num_layers = int(target_config(target_model)["num_hidden_layers"])
        ids = layer_ids or [*default_aux_ids(num_layers), num_layers]
        if not 2 <= ids[-1] <= num_layers:
            raise ValueError(f"the last layer id must be in 2..{num_layers} (L = the final state), got {ids}")
        self.layer_ids, self.shift = ids, shift
        self.extractor = TransformersExtractor(target_model, ids[:-1], "cpu", "float32")
        # A wrong final layer: read as the last aux column of a second extractor.
        self.final_from = (None if ids[-1] == num_layers else
                           TransformersExtractor(target_model, [ids[-1] - 2, ids[-1] - 1, ids[-1]], "cpu", "float32"))
        self.torch = torch
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # one forward at a time on the simulator's single thread budget

    def write(self, prompt_ids: list[int]) -> str:
        from safetensors.torch import save_file

        torch = self.torch
        path = self.out / f"{uuid.uuid4().hex}.safetensors"
        lock_path = f"{path}.lock"
        fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # readers wait until the file is whole
            with self._lock:
                ex = self.extractor.extract([prompt_ids])[0]
                t, h = len(prompt_ids), self.extractor.hidden_size
                final = ex.final if self.final_from is None else self.final_from.extract([prompt_ids])[0].aux[:, 2 * h:]
            layers = torch.cat([ex.aux.reshape(t, -1, h), final.reshape(t, 1, h)], 1)
            if self.shift:
                layers = torch.roll(layers, self.shift, 0)
            save_file({"token_ids": torch.tensor(prompt_ids, dtype=torch.long),
                       "hidden_states": layers.to(torch.bfloat16).contiguous()}, str(path))
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        return str(path)
