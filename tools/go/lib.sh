# Shared by scripts/install-test-deps-*.sh and tools/go/tool-path.sh (sourced, not run).
#
# Every Go-built test component has one tools module, tools/go/<tool>/, holding:
#   go.mod, go.sum  the pinned module graph (committed);
#   tool.env        TOOL_PKG (main package), TOOL_VERSION (the upstream version the binary
#                   reports), TOOL_CGO (0/1), TOOL_LDFLAGS (version stamps), TOOL_BIN,
#                   TOOL_MODULE (build from another tool's go.mod: two programs of one
#                   upstream module share one pinned graph, e.g. promtool and prometheus),
#                   TOOL_TAGS (Go build tags, space-separated: upstream's own switches to
#                   leave out what the tests never use).
# The binary goes to a cache outside the clone (CI clones afresh each run), keyed by tool
# version, build tags, the go.sum hash and the Go version, so a present binary is never
# rebuilt and a change to any of them builds a new one beside it.

TAINTGATE_TOOLS_DIR=${TAINTGATE_TOOLS_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}
TAINTGATE_TOOLS_CACHE=${TAINTGATE_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/taintgate-tools}

# The oldest Go every tools module builds with (the newest `go` line among the go.mod files).
TAINTGATE_MIN_GO=1.26.7

tg_go_check() {
    if ! command -v go >/dev/null 2>&1; then
        echo "error: go not found; the test components are built from Go modules and need Go >= $TAINTGATE_MIN_GO (install Go, or put it on PATH)" >&2
        return 2
    fi
    local have
    have=$(go env GOVERSION 2>/dev/null) || have=""
    have=${have#go}
    if [ -z "$have" ] || [ "$(printf '%s\n%s\n' "$TAINTGATE_MIN_GO" "$have" | sort -V | head -1)" != "$TAINTGATE_MIN_GO" ]; then
        echo "error: Go ${have:-unknown} is too old; the test components need Go >= $TAINTGATE_MIN_GO" >&2
        return 2
    fi
}

# tg_tool_path TOOL: print where TOOL's binary for this checkout lives (built or not).
tg_tool_path() {
    local tool=$1 dir="$TAINTGATE_TOOLS_DIR/$1"
    [ -f "$dir/tool.env" ] || { echo "error: no tools module $dir" >&2; return 2; }
    (
        # shellcheck disable=SC1091
        . "$dir/tool.env"
        local sum gov
        sum=$(sha256sum "$TAINTGATE_TOOLS_DIR/${TOOL_MODULE:-$tool}/go.sum" | cut -c1-12)
        gov=$(go env GOVERSION)
        local tags=${TOOL_TAGS:+-${TOOL_TAGS// /,}}
        echo "$TAINTGATE_TOOLS_CACHE/$tool/$TOOL_VERSION$tags-$sum-$gov/${TOOL_BIN:-$tool}"
    )
}

# tg_build TOOL: build TOOL into the cache unless it is already there. Prints timings.
tg_build() {
    local tool=$1 dir="$TAINTGATE_TOOLS_DIR/$1" out
    out=$(tg_tool_path "$tool") || return 2
    if [ -x "$out" ]; then
        echo "  $tool: cached at $out"
        return 0
    fi
    (
        # shellcheck disable=SC1091
        . "$dir/tool.env"
        local start tmp
        start=$(date +%s)
        mkdir -p "$(dirname "$out")"
        tmp="$out.tmp.$$"
        echo "  $tool $TOOL_VERSION: building $TOOL_PKG (cold builds take minutes)"
        cd "$TAINTGATE_TOOLS_DIR/${TOOL_MODULE:-$tool}"
        # -mod=readonly: go.mod and go.sum are committed and must already be complete.
        if ! CGO_ENABLED=${TOOL_CGO:-0} go build -mod=readonly -trimpath -tags "${TOOL_TAGS:-}" \
            -ldflags "-s -w ${TOOL_LDFLAGS:-}" -o "$tmp" "$TOOL_PKG"; then
            rm -f "$tmp"
            echo "error: building $tool ($TOOL_PKG) failed" >&2
            exit 1
        fi
        mv -f "$tmp" "$out"
        echo "  $tool: built in $(($(date +%s) - start))s -> $out"
    )
}
