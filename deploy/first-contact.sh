#!/usr/bin/env bash
# Before a long run: one request to the served model with thinking on and one with thinking off, printed raw, and
# the checks that decide whether eagle3q's samples will be right (docs/data-and-formats.md, "Token-exact capture"):
#   - the </think> id is in token_ids (thinking on) and the reasoning/content split is there;
#   - content is not null; the generation ends with the end-of-turn id or a reported stop_reason;
#   - prompt_token_ids and token_ids come back (return_token_ids).
# Usage: deploy/first-contact.sh [BASE_URL] [MODEL]   (defaults: http://localhost:8000/v1, moonshotai/Kimi-K2.5)
# Exits non-zero when a check fails. Needs curl and python3. VLLM_API_KEY is sent when set.
set -euo pipefail
BASE="${1:-${EAGLE3Q_VLLM_BASE_URLS:-http://localhost:8000/v1}}"
BASE="${BASE%%,*}"
MODEL="${2:-${EAGLE3Q_MODEL:-moonshotai/Kimi-K2.5}}"
AUTH=()
if [ -n "${VLLM_API_KEY:-}" ]; then AUTH=(-H "Authorization: Bearer ${VLLM_API_KEY}"); fi
ROOT="${BASE%/v1}"

post() {  # post PATH JSON (an error's body is printed: it names the problem)
  curl -sS --fail-with-body "${AUTH[@]}" -H 'Content-Type: application/json' -d "$2" "${BASE}$1"
}

echo "== server: ${BASE} (model ${MODEL})"
curl -fsS "${AUTH[@]}" "${ROOT}/version" 2>/dev/null && echo || echo "(no /version)"
CLOSE=$(curl -fsS "${AUTH[@]}" -H 'Content-Type: application/json' \
  -d "{\"model\": \"${MODEL}\", \"prompt\": \"</think>\", \"add_special_tokens\": false}" "${ROOT}/tokenize")
# max_tokens within the served context: vLLM refuses a max_tokens over --max-model-len outright (400).
MAX_LEN=$(curl -fsS "${AUTH[@]}" "${BASE}/models" | MODEL="${MODEL}" python3 -c '
import json, os, sys
data = json.load(sys.stdin).get("data") or [{}]
m = next((d for d in data if d.get("id") == os.environ["MODEL"]), data[0])
print(m.get("max_model_len") or 0)')
MAX_TOKENS=2048
if [ "${MAX_LEN}" -gt 0 ] && [ $((MAX_LEN / 2)) -lt "${MAX_TOKENS}" ]; then MAX_TOKENS=$((MAX_LEN / 2)); fi
echo "== max_model_len ${MAX_LEN}: max_tokens ${MAX_TOKENS}"
FAIL=0
for THINKING in true false; do
  BODY=$(cat <<JSON
{"model": "${MODEL}", "messages": [{"role": "user", "content": "What is 17 times 23? Answer briefly."}],
 "max_tokens": ${MAX_TOKENS}, "temperature": 0.6, "top_p": 0.95, "return_token_ids": true, "skip_special_tokens": false,
 "chat_template_kwargs": {"thinking": ${THINKING}, "enable_thinking": ${THINKING}}}
JSON
)
  echo "== thinking=${THINKING}: raw response"
  RESP=$(post /chat/completions "${BODY}")
  echo "${RESP}"
  if ! THINKING="${THINKING}" CLOSE="${CLOSE}" RESP="${RESP}" python3 - <<'PY'
import json, os, sys
resp, thinking = json.loads(os.environ["RESP"]), os.environ["THINKING"] == "true"
close_ids = json.loads(os.environ["CLOSE"]).get("tokens") or []
ch = resp["choices"][0]
msg, ids, prompt = ch.get("message") or {}, ch.get("token_ids"), resp.get("prompt_token_ids")
reasoning = msg.get("reasoning") if msg.get("reasoning") is not None else msg.get("reasoning_content")
checks = [
    ("token_ids and prompt_token_ids returned", ids is not None and prompt is not None),
    ("finish_reason is stop", ch.get("finish_reason") == "stop"),
    ("content is not null", msg.get("content") is not None),
]
if thinking:
    checks += [("</think> is one token", len(close_ids) == 1),
               ("the </think> id is in token_ids", bool(ids) and len(close_ids) == 1 and close_ids[0] in ids),
               ("reasoning came back", bool((reasoning or "").strip()))]
else:
    checks += [("no </think> in token_ids", not (ids and len(close_ids) == 1 and close_ids[0] in ids))]
print(f"   stop_reason={ch.get('stop_reason')!r} last id={ids[-1] if ids else None}")
bad = 0
for name, ok in checks:
    print(f"   [{'ok' if ok else 'FAIL'}] {name}")
    bad += not ok
sys.exit(1 if bad else 0)
PY
  then FAIL=1; fi
done
if [ "${FAIL}" -ne 0 ]; then echo "== first contact: FAILED (see above; do not start the long run)"; exit 1; fi
echo "== first contact: all checks passed"
