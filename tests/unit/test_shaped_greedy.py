"""The rule that makes a random target answer like a reasoning model, in vLLM's engine and in the reference."""

from __future__ import annotations

from eagle3q.dev.shaped_greedy import ShapedGreedy


def _walk(rule: ShapedGreedy, prompt: list[int]) -> list[int | None]:
    out: list[int] = []
    forced: list[int | None] = []
    while not out or out[-1] != rule.end_id:
        f = rule.forced(prompt, out)
        forced.append(f)
        out.append(f if f is not None else 7)  # any token the model would choose
    return forced


def test_markers_are_placed_once_at_lengths_drawn_from_the_prompt() -> None:
    for opens in (True, False):
        rule = ShapedGreedy(open_id=1, close_id=2, end_id=3, prompt_opens_think=opens)
        for prompt in ([10, 11, 12], [10, 11, 13], list(range(10, 60))):
            n_reason, n_answer = rule.lengths(prompt)
            forced = _walk(rule, prompt)
            lead = [] if opens else [1]
            assert forced == [*lead, *[None] * n_reason, 2, *[None] * n_answer, 3]
    a, b = ShapedGreedy(1, 2, 3, True).lengths([10, 11, 12]), ShapedGreedy(1, 2, 3, True).lengths([10, 11, 12])
    assert a == b  # deterministic: the reference and the engine agree on a prompt's lengths


def test_thinking_off_answers_without_markers() -> None:
    """A prompt whose template closed the reasoning (Kimi-K2.5's `<think></think>`): the answer, then the end of
    turn, and no `</think>` generated (deploy/first-contact.sh's thinking-off request fails on one)."""
    for opens in (True, False):
        rule = ShapedGreedy(open_id=1, close_id=2, end_id=3, prompt_opens_think=opens)
        prompt = [10, 11, 1, 2]
        assert rule.thinking_off(prompt) and not rule.thinking_off([10, 11, 1]) and not rule.thinking_off([10])
        assert not rule.thinking_off([1, 2, 5, 1])  # an earlier closed block, then a new one opened: thinking on
        assert not rule.thinking_off([1, 9, 2, 20, 21, 22, 23, 24])  # a closed block in the history: on
        assert rule.thinking_off([20, 1, 9, 9, 2, 9, 9])  # Qwen3's `<think>\n\n</think>\n\n`
        _, n_answer = rule.lengths(prompt)
        assert _walk(rule, prompt) == [*[None] * n_answer, 3]


def test_lengths_vary_with_the_prompt_around_the_mean() -> None:
    rule = ShapedGreedy(1, 2, 3, True, mean_tokens=48)
    totals = {sum(rule.lengths([i, i + 1])) for i in range(40)}
    assert len(totals) > 10 and min(totals) >= 20 and max(totals) <= 80
    assert set(rule.suppressed) == {0, 1, 2, 3}
