#!/usr/bin/env python3
"""Generate the NOT_SUPPORTED stubs of the fake libnvidia-ml.so.1 from NVIDIA's nvml.h.

    gen-stubs.py --include DIR --out FILE [--cc CC]

Every function nvml.h declares gets a definition in FILE that returns
NVML_ERROR_NOT_SUPPORTED (0 for the rare non-nvmlReturn_t return type). The header is
read through the C preprocessor with NVML_NO_UNVERSIONED_FUNC_DEFS, which turns off its
`#define nvmlInit nvmlInit_v2` renames and declares the legacy unversioned entry points
the real driver still exports (nvmlInit, nvmlDeviceGetCount, ...), so both the versioned
and the legacy names get a symbol. Each stub's signature is the header's own declaration
text, so the compiler checks it against the prototype.

The stubs are weak: fake_nvml.c defines the functions the profile drives, and its strong
definitions win at link time, so this script does not need to know which those are.

A few names that nvml-wrapper-sys 0.10 loads are declared only by newer headers than the
pinned wheel's (EXTRA below); they get a `(void)` stub so every symbol that crate looks up
exists (a signature the header cannot check, and none of them is called by taintgate).
"""
import argparse
import os
import re
import subprocess
import sys

# nvml-wrapper-sys 0.10's bindings load these; nvml.h from nvidia-nvml-dev-cu12 12.9.79
# does not declare them. validators/tests/nvml_fake.rs checks that every name the crate
# loads is exported, so a newer crate adding more fails there, naming them.
EXTRA = [
    "nvmlDeviceGetAddressingMode",
    "nvmlDeviceGetGpuInstanceProfileInfoByIdV",
    "nvmlDeviceGetNvLinkInfo",
    "nvmlDeviceGetPdi",
    "nvmlDeviceGetPowerMizerMode_v1",
    "nvmlDeviceGetRepairStatus",
    "nvmlDeviceGetSramUniqueUncorrectedEccErrorCounts",
    "nvmlDeviceReadWritePRM_v1",
    "nvmlDeviceSetPowerMizerMode_v1",
]

# Declarations in the raw header text (any branch of its #ifs): the cross-check below.
RAW_DECL = re.compile(r"\bDECLDIR\s+(?:char\s*\*\s*)?(nvml\w+)\s*\(")
DECL = re.compile(r"^(?P<ret>[\w\s\*]+?)\s*\b(?P<name>nvml\w+)\s*\((?P<params>.*)\)$", re.S)
C_TYPE_WORDS = {"const", "volatile", "unsigned", "signed", "int", "char", "short", "long",
                "float", "double", "void", "struct", "enum", "union"}


def top_level_statements(text):
    """Split preprocessed C into its top-level `;`-terminated statements."""
    out, cur, depth = [], [], 0
    for ch in text:
        if ch in "{(":
            depth += 1
        elif ch in "})":
            depth -= 1
        if ch == ";" and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    return out


def name_params(name, params):
    """The parameter list with a name for any parameter the header left unnamed."""
    if params.strip() in ("", "void"):
        return "void"
    parts, cur, depth = [], [], 0
    for ch in params:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur).strip())
    named = []
    for i, p in enumerate(parts):
        if "(" in p or p == "...":
            sys.exit(f"gen-stubs: {name}: cannot handle parameter `{p}`")
        base = re.sub(r"\[[^\]]*\]\s*$", "", p).strip()
        words = re.findall(r"[A-Za-z_]\w*", base)
        last_is_name = (
            bool(words)
            and words[-1] not in C_TYPE_WORDS
            and re.search(r"[A-Za-z_]\w*$", base) is not None
            and (len([w for w in words if w not in ("const", "volatile")]) >= 2 or "*" in base.split(words[-1])[0])
        )
        named.append(p if last_is_name else f"{p} arg{i}")
    return ", ".join(named)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--include", required=True, help="directory holding nvml.h")
    ap.add_argument("--out", required=True)
    ap.add_argument("--cc", default=os.environ.get("CC", "cc"))
    args = ap.parse_args()

    header = os.path.join(args.include, "nvml.h")
    with open(header, encoding="utf-8", errors="replace") as f:
        raw_names = set(RAW_DECL.findall(f.read()))
    pp = subprocess.run(
        [args.cc, "-E", "-P", "-DNVML_NO_UNVERSIONED_FUNC_DEFS", "-I", args.include, "-x", "c", "-"],
        input="#include <nvml.h>\n",
        capture_output=True,
        text=True,
    )
    if pp.returncode != 0:
        sys.exit(f"gen-stubs: {args.cc} -E on {header} failed:\n{pp.stderr}")

    decls = {}
    for stmt in top_level_statements(pp.stdout):
        stmt = " ".join(stmt.split())
        if stmt.startswith("typedef") or "nvml" not in stmt:
            continue
        m = DECL.match(stmt)
        if not m or not m.group("ret").strip():
            continue
        decls.setdefault(m.group("name"), (m.group("ret").strip(), m.group("params")))

    if set(decls) != raw_names:
        sys.exit(
            "gen-stubs: parsed declarations differ from the header's DECLDIR names: "
            f"only parsed {sorted(set(decls) - raw_names)}, only in the text {sorted(raw_names - set(decls))}"
        )

    lines = [
        "/* Generated by tests/fake-nvml/gen-stubs.py from " + header + ". Do not edit. */",
        "/* The header's own names: no `#define nvmlInit nvmlInit_v2`, legacy ones declared. */",
        "#define NVML_NO_UNVERSIONED_FUNC_DEFS",
        "#include <nvml.h>",
        "",
    ]
    for name in sorted(decls):
        ret, params = decls[name]
        body = "return NVML_ERROR_NOT_SUPPORTED;" if ret == "nvmlReturn_t" else "return 0;"
        lines.append(f"__attribute__((weak)) {ret} {name}({name_params(name, params)}) {{ {body} }}")
    lines.append("")
    lines.append("/* Loaded by nvml-wrapper-sys 0.10, declared only by newer nvml.h versions. */")
    for name in EXTRA:
        if name in decls:
            continue
        lines.append(f"nvmlReturn_t {name}(void);")
        lines.append(f"__attribute__((weak)) nvmlReturn_t {name}(void) {{ return NVML_ERROR_NOT_SUPPORTED; }}")
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, args.out)
    print(f"gen-stubs: {len(decls)} nvml.h functions, {len([n for n in EXTRA if n not in decls])} extra", file=sys.stderr)


if __name__ == "__main__":
    main()
