#!/bin/sh
# Writes rumor's default language-model corpus: the King James Bible as plain
# text (about 4.3 MB), printed by `bible` from Debian's bible-kjv package
# (`bible "Gen1:1-Rev22:21"`, every verse from Genesis 1:1 to Revelation
# 22:21). rumor reads plain text as byte-level tokens (0..255).
#
# usage: deploy/make-corpus.sh [OUT]
#
# OUT defaults to kjv.txt in the current directory; deploy/install-deps.sh
# writes /usr/local/share/rumor/kjv.txt, the path rumor looks at by default.
# The text is written to a temporary file beside OUT and renamed, so OUT is
# never left half-written. COLUMNS is unset because `bible` wraps its lines at
# that width: the file is then the same on every machine.
set -eu

out=${1:-kjv.txt}
command -v bible >/dev/null 2>&1 || {
  echo "make-corpus.sh: bible not found (install Debian's bible-kjv package)" >&2
  exit 1
}
dir=$(dirname "$out")
mkdir -p "$dir"
tmp=$(mktemp "$dir/.kjv.XXXXXX")
trap 'rm -f "$tmp"' EXIT
env -u COLUMNS bible "Gen1:1-Rev22:21" </dev/null >"$tmp"
# A truncated or empty print (a missing data file) must not become the corpus.
size=$(wc -c <"$tmp" | tr -d " ")
if [ "$size" -lt 4000000 ]; then
  echo "make-corpus.sh: bible printed only $size bytes (expected about 4.3 MB)" >&2
  exit 1
fi
chmod 644 "$tmp"
mv -f "$tmp" "$out"
trap - EXIT
echo "make-corpus.sh: wrote $out ($size bytes)"
