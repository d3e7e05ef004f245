#!/usr/bin/env bash
# The README's pictures: the replay page (tinydiff/tools/replay.py) of a diffusion run and of a DDTree run of
# the tour's models (README, "A fifteen-minute CPU tour"), rendered by headless Chromium into docs/img/.
#   scripts/replay_screenshots.sh            # MDLM=out/tour-mdlm/ckpt.pt AR=out/tour-ar/ckpt.pt DRAFTER=...
# Each page is kept beside its picture's run in $PAGES (default: a temp folder) and its size printed.
set -euo pipefail
cd "$(dirname "$0")/.."
MDLM=${MDLM:-out/tour-mdlm/ckpt.pt} AR=${AR:-out/tour-ar/ckpt.pt} DRAFTER=${DRAFTER:-out/tour-dflash/ckpt.pt}
PAGES=${PAGES:-$(mktemp -d)} P=${P:-"Once upon a time"}
CHROMIUM=$(command -v chromium || command -v chromium-browser) || { echo "needs chromium (apt-get install chromium)"; exit 1; }
mkdir -p "$PAGES" && rm -f "$PAGES/diffusion.html" "$PAGES/ddtree.html"
python generate.py --ckpt "$MDLM" --prompt "$P" --max-new-tokens 128 --seed 1 --html "$PAGES/diffusion.html"
python generate.py --ckpt "$AR" --method ddtree --draft "$DRAFTER" --budget 32 --prompt "$P" --max-new-tokens 64 \
  --temperature 0 --html "$PAGES/ddtree.html"
ls -l "$PAGES"/*.html
# The diffusion picture mid-run (block 2 filling in); the DDTree one at the round whose path went deepest.
deepest=$(python -c "import html, json, sys; t = open(sys.argv[1]).read().split('id=\"events\">')[1].split('</script>')[0]
s = json.loads(html.unescape(t))['steps']; print(1 + max(range(len(s)), key=lambda i: len(s[i]['path'])))" "$PAGES/ddtree.html")
shot() {  # page, step, picture, window height
  "$CHROMIUM" --headless --no-sandbox --disable-gpu --hide-scrollbars --user-data-dir="$PAGES/chrome" \
    --window-size=1000,"$4" --screenshot="$3" "file://$(realpath "$1")#step=$2" 2>/dev/null
}
shot "$PAGES/diffusion.html" 48 docs/img/replay-diffusion.png 520
shot "$PAGES/ddtree.html" "$deepest" docs/img/replay-ddtree.png 620
ls -l docs/img/replay-*.png
