"""Chat templates of the supported families, rendered the way the real templates render a generation prompt."""

from __future__ import annotations

from eagle3q.generate.profiles import Profile


def render_prompt(profile: Profile, messages: list[dict[str, str]], thinking: bool) -> str:
    if profile.name == "kimi_k2":
        out = []
        for m in messages:
            tag = {"system": "<|im_system|>", "user": "<|im_user|>", "assistant": "<|im_assistant|>"}[m["role"]]
            out.append(f"{tag}{m['role']}<|im_middle|>{m['content']}<|im_end|>")
        out.append("<|im_assistant|>assistant<|im_middle|>")
        out.append("<think>" if thinking else "<think></think>")
        return "".join(out)
    if profile.name == "qwen3":
        out = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
        out.append("<|im_start|>assistant\n")
        if not thinking:
            out.append("<think>\n\n</think>\n\n")
        return "".join(out)
    if profile.name == "deepseek_r1":
        out = ["<｜begin▁of▁sentence｜>"]
        for m in messages:
            if m["role"] == "system":
                out.append(m["content"])
            elif m["role"] == "user":
                out.append(f"<｜User｜>{m['content']}")
            else:
                out.append(f"<｜Assistant｜>{m['content']}<｜end▁of▁sentence｜>")
        out.append("<｜Assistant｜><think>\n")
        return "".join(out)
    raise ValueError(f"no template for profile {profile.name}")
