#!/usr/bin/env bash
# Builds the book (docs/, mdBook) and checks its links; a step of
# scripts/test.sh, so of CI. Installs its tools first, idempotently, into
# ~/.cache/stoke/tools, as scripts/s3-server.sh installs s3s-fs:
#
# - mdbook 0.4.52, the last 0.4 release: mdbook-linkcheck speaks only to
#   mdBook 0.4 (0.5 changed the book's structure renderers read);
# - mdbook-linkcheck 0.7.7, a second renderer that fails the build on a
#   link to a file that does not exist (a chapter, an image, an include);
# - then scripts/book_links.py over the rendered HTML: every relative link
#   and every #anchor within the book, and every link from README.md into
#   docs/ (mdbook-linkcheck does not check anchors, nor the README).
#
# External http(s) links are not checked: this machine and CI reach no
# network but the package registries (mdbook-linkcheck's follow-web-links
# stays off, and book_links.py skips them).
#
# `scripts/book.sh` builds into docs/book/ (html/ is the book to open);
# `scripts/book.sh --install` only installs the tools and prints mdbook's
# path.
set -euo pipefail
STOKE_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STOKE_CACHE="${STOKE_CACHE:-$HOME/.cache/stoke}"
TOOLS="$STOKE_CACHE/tools"
MDBOOK_VERSION="0.4.52"
LINKCHECK_VERSION="0.7.7"

install_tool() {
  local crate="$1" version="$2" minutes="$3"
  local bin="$TOOLS/bin/$crate" marker="$TOOLS/.$crate-$version"
  if [ ! -x "$bin" ] || [ ! -f "$marker" ]; then
    echo "stoke: installing $crate $version into $TOOLS (first time: about $minutes minutes)" >&2
    mkdir -p "$TOOLS"
    # Its own target folder, so it neither shares nor invalidates stoke's;
    # no default features: neither needs a web server or a file watcher.
    CARGO_TARGET_DIR="$STOKE_CACHE/tools-target" \
      cargo install -q --locked "$crate@$version" --no-default-features \
      "${@:4}" --root "$TOOLS" >&2
    rm -f "$TOOLS/.$crate-"[0-9]*
    touch "$marker"
  fi
}

install_tool mdbook "$MDBOOK_VERSION" 5 --features search
install_tool mdbook-linkcheck "$LINKCHECK_VERSION" 8
if [ "${1:-}" = "--install" ]; then
  echo "$TOOLS/bin/mdbook"
  exit 0
fi

# mdbook finds its renderers (mdbook-linkcheck) on PATH.
export PATH="$TOOLS/bin:$PATH"
rm -rf "$STOKE_REPO/docs/book"
mdbook build "$STOKE_REPO/docs"
python3 "$STOKE_REPO/scripts/book_links.py" "$STOKE_REPO/docs/book/html" "$STOKE_REPO"
