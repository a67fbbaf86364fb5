#!/usr/bin/env bash
# kvlite serve with plain curl, as a user tries it first: a chat with an image (base64 data: URI), streamed and
# not, captions scene_3.png as the captioner must; a bad body gets 400 with OpenAI's error shape.
#   tests/serve_curl.sh BUILD_DIR      (from the repository root; exit 77 = skipped when curl is absent)
set -uo pipefail
build=$1
command -v curl >/dev/null || { echo "skipped: curl is not installed"; exit 77; }
log=$(mktemp)
"$build/kvlite" serve models/kvlite-captioner-bf16 --port 0 --backend cpu > "$log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null; rm -f "$log" "$log.body"' EXIT
port=""
for _ in $(seq 1 100); do
  port=$(grep -o 'http://127.0.0.1:[0-9]*' "$log" | head -1 | cut -d: -f3)
  [ -n "$port" ] && break
  sleep 0.1
done
[ -n "$port" ] || { echo "kvlite serve did not start:"; cat "$log"; exit 1; }
expected=$(grep '^scene_3.png' examples/images/captions.txt | cut -f2)
image=$(base64 -w0 examples/images/scene_3.png)
body="{\"temperature\":0,\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\",\"image_url\":{\"url\":\"data:image/png;base64,$image\"}},{\"type\":\"text\",\"text\":\"Describe this image.\"}]}]"
failures=0
reply=$(curl -s "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' -d "$body}")
case "$reply" in *"\"content\":\"$expected\""*) echo "chat: ok" ;; *) echo "chat: $reply"; failures=$((failures + 1)) ;; esac
stream=$(curl -sN "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' \
         -d "$body,\"stream\":true}")
text=$(printf '%s\n' "$stream" | sed -n 's/^data: \(.*"content":"\([^"]*\)".*\)$/\2/p' | tr -d '\n')
if [ "$text" = "$expected" ] && [[ "$stream" == *"data: [DONE]"* ]]; then echo "stream: ok"; else
  echo "stream: '$text'"; failures=$((failures + 1)); fi
status=$(curl -s -o "$log.body" -w '%{http_code}' "http://127.0.0.1:$port/v1/chat/completions" \
         -H 'Content-Type: application/json' -d '{"messages": 5}')
if [ "$status" = 400 ] && grep -q '"error"' "$log.body"; then echo "bad body: 400 ok"; else
  echo "bad body: $status $(cat "$log.body")"; failures=$((failures + 1)); fi
echo "curl against kvlite serve: $failures failures"
[ "$failures" -eq 0 ]
