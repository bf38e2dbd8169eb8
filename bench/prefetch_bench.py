#!/usr/bin/env python3
"""Loopback benchmark of taintgate's bundle prefetch against rclone, aria2c, curl (HTTP,
nginx origin) and s5cmd, rclone (S3, moto origin).

Competitors do not verify what they download, so each is reported raw and "verified":
raw download time plus the fastest available sha256 pass over what it wrote
(`openssl dgst -sha256`, one process per file, all cores). taintgate verifies inline.

Everything lives under --data (default /tmp/tg-bench) and --dest (default /dev/shm/tg-bench,
a tmpfs, so every tool writes to memory and the disk is not what is measured; taintgate
still fsyncs every blob). Medians of --repeats runs are reported.
"""

import argparse
import hashlib
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

MIB = 1 << 20
GIB = 1 << 30


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def wait_tcp(port, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"port {port} never opened")


def gen_file(path, size):
    """Incompressible data fast: AES-CTR keystream from openssl."""
    if os.path.exists(path) and os.path.getsize(path) == size:
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "wb") as out, open("/dev/zero", "rb") as zero:
        enc = subprocess.Popen(
            ["openssl", "enc", "-aes-128-ctr", "-pbkdf2", "-nosalt", "-pass", "pass:" + os.path.basename(path)],
            stdin=zero,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        left = size
        while left:
            chunk = enc.stdout.read(min(left, 8 * MIB))
            out.write(chunk)
            left -= len(chunk)
        enc.kill()
        enc.wait()
    os.rename(tmp, path)


def make_dataset(root, big, small_count, small_size):
    gen_file(os.path.join(root, "big.bin"), big)
    for i in range(small_count):
        gen_file(os.path.join(root, "small", f"s{i:03}.bin"), small_size)


def all_files(root):
    out = []
    for d, _, fs in os.walk(root):
        for f in fs:
            out.append(os.path.join(d, f))
    return sorted(out)


def child_cpu():
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run(cmd, **kw):
    """Run to completion; returns (wall seconds, stdout). The CPU seconds the command used
    (user + system, all its threads) are left in LAST_CPU."""
    global LAST_CPU
    c0 = child_cpu()
    t = time.perf_counter()
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)
    dt = time.perf_counter() - t
    LAST_CPU = child_cpu() - c0
    if r.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({r.returncode}): {r.stderr.decode()[-2000:]}")
    return dt, r.stdout


LAST_CPU = 0.0


def openssl_hash(root):
    """Fastest available sha256 pass: openssl, one process per file, all cores. Returns
    (seconds, {relpath: digest})."""
    files = all_files(root)
    c0 = child_cpu()
    t = time.perf_counter()
    procs = subprocess.run(
        ["xargs", "-0", "-P", str(os.cpu_count() or 2), "-n", "8", "openssl", "dgst", "-sha256", "-r"],
        input=b"\0".join(f.encode() for f in files),
        stdout=subprocess.PIPE,
        check=True,
    )
    dt = time.perf_counter() - t
    global LAST_CPU
    LAST_CPU = child_cpu() - c0
    digests = {}
    for line in procs.stdout.decode().splitlines():
        d, p = line.split(" ", 1)
        digests[os.path.relpath(p.lstrip("*"), root)] = d
    return dt, digests


def drop_page_cache():
    """Start from free memory, as a freshly booted node does. On this VM a page cache filled
    by earlier work (builds, test runs) slowed every run: the same engine binary took
    5.2-6.8 s right after a drop and 8.6-13.4 s before it, with rclone far less affected.
    Needs root; otherwise the run says so and goes on."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        log("dropped the page cache (start from free memory)")
    except OSError as e:
        log(f"could not drop the page cache ({e}); figures then depend on the memory state")


def fill_rate(dest, size=GIB):
    """GB/s at which this machine fills fresh page-cache pages: one file of zeros written to
    the tmpfs the tools write to, then removed. Every tool pays this per byte it writes, and
    on this project's VM it is not a constant: the host backs a fresh guest page lazily
    (free page reporting hands freed memory back), and the same 4 GiB took 2.2 s of system
    time in one memory state and 4-5.7 s in another. Measured before every round so the
    table can be read against the state it was measured in."""
    path = os.path.join(dest, "fill-rate.tmp")
    buf = bytes(MIB)
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(size // MIB):
            os.write(fd, buf)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t
    os.remove(path)
    return size / dt / 1e9


def drop_dir(p):
    shutil.rmtree(p, ignore_errors=True)


class Nginx:
    def __init__(self, root, workdir):
        self.port = free_port()
        os.makedirs(workdir, exist_ok=True)
        conf = os.path.join(workdir, "nginx.conf")
        with open(conf, "w") as f:
            f.write(f"""daemon off; master_process on; worker_processes auto;
pid {workdir}/nginx.pid; error_log {workdir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off; sendfile on; tcp_nopush on; keepalive_requests 100000;
  client_body_temp_path {workdir}/c; proxy_temp_path {workdir}/p; fastcgi_temp_path {workdir}/f;
  uwsgi_temp_path {workdir}/u; scgi_temp_path {workdir}/s;
  default_type application/octet-stream;
  server {{ listen 127.0.0.1:{self.port}; root {root}; autoindex on; }}
}}
""")
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        self.proc = subprocess.Popen([nginx, "-c", conf, "-p", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_tcp(self.port)

    def url(self, path=""):
        return f"http://127.0.0.1:{self.port}/{path}"

    def stop(self):
        self.proc.send_signal(signal.SIGQUIT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class Moto:
    def __init__(self, venv):
        self.port = free_port()
        self.proc = subprocess.Popen([os.path.join(venv, "bin", "moto_server"), "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_tcp(self.port)

    @property
    def endpoint(self):
        return f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.proc.kill()
        self.proc.wait()


def median_runs(name, repeats, fn):
    times = []
    for i in range(repeats):
        t = fn()
        log(f"  {name} run {i + 1}: {t:.2f} s")
        times.append(t)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", required=True, help="taintgate prefetch engine (prefetch/examples/fetch)")
    ap.add_argument("--data", default="/tmp/tg-bench")
    ap.add_argument("--dest", default="/dev/shm/tg-bench")
    ap.add_argument("--repeats", type=int, default=int(os.environ.get("REPEATS", "3")))
    ap.add_argument("--big-gib", type=float, default=3.0)
    ap.add_argument("--small-count", type=int, default=200)
    ap.add_argument("--small-mib", type=int, default=5)
    ap.add_argument("--s3-big-mib", type=int, default=192)
    ap.add_argument("--s3-small-count", type=int, default=16)
    ap.add_argument("--s3-small-mib", type=int, default=4)
    ap.add_argument("--skip-s3", action="store_true")
    ap.add_argument("--warmup", type=int, choices=(0, 1), default=1, help="run one discarded round first")
    ap.add_argument("--drop-caches", type=int, choices=(0, 1), default=1,
                    help="drop the page cache before the run (needs root; see drop_page_cache)")
    ap.add_argument("--only", default="", help="comma list of tools to run (debug)")
    ap.add_argument("--engine-args", default="", help="extra args for the engine (tuning)")
    ap.add_argument("--sweep", default="",
                    help="tune the engine's defaults: space-separated CONCURRENCY:FILE_CONCURRENCY:CHUNK_MIB "
                         "variants, each run as one more taintgate row in the same round-robin")
    args = ap.parse_args()
    venv = os.path.dirname(os.path.dirname(os.path.abspath(sys.executable)))
    only = set(filter(None, args.only.split(",")))
    want = lambda t: not only or t in only
    extra = args.engine_args.split()

    http_root = os.path.join(args.data, "http")
    make_dataset(http_root, int(args.big_gib * GIB), args.small_count, args.small_mib * MIB)
    total = sum(os.path.getsize(f) for f in all_files(http_root))
    log(f"data set: {total / GIB:.2f} GiB in {len(all_files(http_root))} files under {http_root}")
    os.makedirs(args.dest, exist_ok=True)
    work = tempfile.mkdtemp(prefix="tg-bench-work-")
    manifest = os.path.join(work, "manifest.yaml")

    nginx = Nginx(http_root, os.path.join(work, "nginx"))
    rows = []  # (tool, mode, seconds, cpu seconds or None)
    raws = {}
    hash_only = None
    hash_only_samples, warm_samples, fill_samples = [], [], []
    try:
        _, out = run([args.engine, "create", http_root, "--base-uri", nginx.url("")])
        with open(manifest, "wb") as f:
            f.write(out)
        expected = {}
        m = out.decode()
        # Expected digests, for checking what competitors wrote.
        cur = None
        for line in m.splitlines():
            s = line.strip()
            if s.startswith("- path:"):
                cur = s.split(":", 1)[1].strip()
            elif s.startswith("sha256:") and cur:
                expected[cur] = s.split(":", 1)[1].strip()
        # Free memory, then warm the origin's page cache so every tool reads from memory.
        if args.drop_caches:
            drop_page_cache()
        openssl_hash(http_root)

        dest = lambda tool: os.path.join(args.dest, tool)

        def check(root, digests):
            bad = [p for p, d in expected.items() if digests.get(p) != d]
            if bad:
                raise RuntimeError(f"{root}: {len(bad)} files wrong, e.g. {bad[:3]}")

        # Every tool as (name, mode, command, output dir, verifies inline). Repeats run
        # round-robin so load from anything else on the machine hits every tool alike.
        tools = []
        if want("taintgate"):
            tools.append(("taintgate", "verified (inline)",
                          lambda: [args.engine, "fetch", manifest, "--cache", dest("tg"), "--reserve", "0", *extra],
                          os.path.join(dest("tg"), "bundles", "bundle"), True))
            for v in args.sweep.split():
                c, fc, mib = (int(x) for x in v.split(":"))
                tools.append(("taintgate", f"verified, concurrency {c}, file {fc}, chunk {mib} MiB",
                              lambda c=c, fc=fc, mib=mib: [
                                  args.engine, "fetch", manifest, "--cache", dest("tg"), "--reserve", "0",
                                  "--concurrency", str(c), "--file-concurrency", str(fc),
                                  "--chunk-size", str(mib * MIB), *extra],
                              os.path.join(dest("tg"), "bundles", "bundle"), "sweep"))
        if want("rclone") and shutil.which("rclone"):
            tools.append(("rclone", "defaults",
                          lambda: ["rclone", "copy", "--http-url", nginx.url(""), ":http:", dest("rclone")],
                          dest("rclone"), False))
            tools.append(("rclone", "tuned",
                          lambda: ["rclone", "copy", "--http-url", nginx.url(""), ":http:", dest("rclone"),
                                   "--http-no-head", "--transfers", "16", "--checkers", "16",
                                   "--multi-thread-streams", "16", "--multi-thread-cutoff", "64M", "--buffer-size", "16M"],
                          dest("rclone"), False))
        if want("aria2c") and shutil.which("aria2c"):
            urls = os.path.join(work, "aria2.txt")
            with open(urls, "w") as f:
                for p in expected:
                    f.write(f"{nginx.url(p)}\n  out={p}\n")
            tools.append(("aria2c", "-x16 -j16",
                          lambda: ["aria2c", "-x16", "-s16", "-j16", "-i", urls, "-d", dest("aria2c"),
                                   "--file-allocation=none", "--allow-overwrite=true", "--auto-file-renaming=false",
                                   "--console-log-level=warn", "--summary-interval=0", "--download-result=hide"],
                          dest("aria2c"), False))
        if want("curl"):
            cfg = os.path.join(work, "curl.cfg")
            with open(cfg, "w") as f:
                for p in expected:
                    f.write(f'url = "{nginx.url(p)}"\noutput = "{os.path.join(dest("curl"), p)}"\n')
            tools.append(("curl", "--parallel 16",
                          lambda: ["curl", "-sS", "-f", "--parallel", "--parallel-max", "16", "--create-dirs", "-K", cfg],
                          dest("curl"), False))

        samples = {}  # (tool, mode) -> list of (download wall, download cpu, hash wall, hash cpu)
        # One discarded round first: the first runs after the data set is written (tmpfs
        # pages, the origin's page cache, binaries) were measured up to 2.5x slower here,
        # and in round-robin order that penalty would land on whichever tool runs first.
        for tool, mode, cmd_fn, out_dir, inline in tools[: args.warmup and len(tools)]:
            base = dest("tg") if tool == "taintgate" else dest(tool)
            drop_dir(base)
            os.makedirs(base, exist_ok=True)
            dt, _ = run(cmd_fn())
            log(f"  warm-up {tool} {mode}: {dt:.2f} s (discarded)")
            drop_dir(base)
        for rep in range(args.repeats):
            fill_samples.append(fill_rate(args.dest))
            log(f"  round {rep + 1}: page-cache fill rate {fill_samples[-1]:.2f} GB/s")
            for tool, mode, cmd_fn, out_dir, inline in tools:
                base = dest("tg") if tool == "taintgate" else dest(tool)
                drop_dir(base)
                os.makedirs(base, exist_ok=True)
                dt, _ = run(cmd_fn())
                dcpu = LAST_CPU
                ht, dg = openssl_hash(out_dir)  # also checks what was written
                hcpu = LAST_CPU
                check(f"{tool} {mode}", dg)
                if inline == "sweep":
                    ht, hcpu = 0.0, 0.0
                elif inline:
                    hash_only_samples.append(ht)
                    ht, hcpu = 0.0, 0.0
                    wt, _ = run(cmd_fn())  # warm restart: everything cached
                    warm_samples.append(wt)
                samples.setdefault((tool, mode), []).append((dt, dcpu, ht, hcpu))
                log(f"  run {rep + 1} {tool} {mode}: download {dt:.2f} s ({dcpu:.1f} cpu-s)"
                    + ("" if inline else f" + hash {ht:.2f} s ({hcpu:.1f} cpu-s)"))
                drop_dir(base)

        med = lambda xs: statistics.median(xs)
        for (tool, mode), xs in samples.items():
            if tool == "taintgate" and mode.startswith("verified, "):
                rows.append((tool, mode, med([x[0] for x in xs]), med([x[1] for x in xs])))
            elif tool == "taintgate":
                rows.append((tool, mode, med([x[0] for x in xs]), med([x[1] for x in xs])))
                rows.append((tool, "warm restart (all cached)", med(warm_samples), None))
            else:
                rows.append((tool, f"{mode}, download only", med([x[0] for x in xs]), med([x[1] for x in xs])))
                rows.append((tool, f"{mode} + openssl sha256", med([x[0] + x[2] for x in xs]),
                             med([x[1] + x[3] for x in xs])))
                raws[f"{tool} {mode}"] = med([x[0] for x in xs])
        if hash_only_samples:
            hash_only = med(hash_only_samples)
    finally:
        nginx.stop()

    s3rows = []
    if not args.skip_s3:
        s3rows = s3_bench(args, venv, work, extra)

    print_table(rows, total, "HTTP (nginx on loopback)")
    tg_t = next((r[2] for r in rows if r[0] == "taintgate" and r[1] == "verified (inline)"), None)
    if tg_t and raws and hash_only:
        best_raw = min(raws.values())
        print(f"\nhash overlap: taintgate {tg_t:.2f} s / max(fastest download-only {best_raw:.2f} s, "
              f"openssl hash-only {hash_only:.2f} s) = {tg_t / max(best_raw, hash_only):.2f}")
        # The same ratio round by round, next to the machine's memory state in that round.
        tg_runs = samples.get(("taintgate", "verified (inline)"), [])
        raw_runs = [xs for (tool, mode), xs in samples.items() if tool != "taintgate"]
        for r, fill in enumerate(fill_samples):
            if r < len(tg_runs) and all(r < len(xs) for xs in raw_runs):
                best = min(xs[r][0] for xs in raw_runs)
                print(f"  round {r + 1}: page-cache fill {fill:.2f} GB/s, taintgate {tg_runs[r][0]:.2f} s / "
                      f"fastest download-only {best:.2f} s = {tg_runs[r][0] / max(best, hash_only):.2f}")
    if s3rows:
        s3_total = (args.s3_big_mib + args.s3_small_count * args.s3_small_mib) * MIB
        print_table(s3rows, s3_total,
                    "S3 (moto on loopback; moto caps near 30 MB/s, so this measures request overhead, not throughput)")
    shutil.rmtree(work, ignore_errors=True)


def s3_bench(args, venv, work, extra):
    root = os.path.join(args.data, "s3")
    make_dataset(root, args.s3_big_mib * MIB, args.s3_small_count, args.s3_small_mib * MIB)
    moto = Moto(venv)
    rows = []
    # A CA bundle set for the real cloud breaks rclone's plain-HTTP loopback client.
    base_env = {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}
    env = dict(base_env, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_REGION="us-east-1",
               AWS_DEFAULT_REGION="us-east-1")
    s5cmd = os.path.join(venv, "bin", "s5cmd")
    try:
        subprocess.run(["curl", "-sS", "-f", "-X", "PUT", f"{moto.endpoint}/bench"], check=True, stdout=subprocess.DEVNULL)
        files = all_files(root)
        for f in files:
            rel = os.path.relpath(f, root)
            # Content-Type matters: without it moto parses the body as a form (very slow).
            subprocess.run(["curl", "-sS", "-f", "-X", "PUT", "-H", "Content-Type: application/octet-stream",
                            "-T", f, f"{moto.endpoint}/bench/{rel}"], check=True, stdout=subprocess.DEVNULL)
        _, out = run([args.engine, "create", root, "--base-uri", "s3://bench"])
        manifest = os.path.join(work, "s3-manifest.yaml")
        with open(manifest, "wb") as fh:
            fh.write(out)
        dest = lambda t: os.path.join(args.dest, "s3-" + t)
        opts = ["--opt", f"aws_endpoint={moto.endpoint}", "--opt", "aws_allow_http=true",
                "--opt", "aws_access_key_id=testing", "--opt", "aws_secret_access_key=testing",
                "--opt", "aws_region=us-east-1"]

        def tg():
            drop_dir(dest("tg"))
            return run([args.engine, "fetch", manifest, "--cache", dest("tg"), "--reserve", "0", *opts, *extra])[0]
        rows.append(("taintgate", "verified (inline)", median_runs("s3 taintgate", args.repeats, tg)))
        drop_dir(dest("tg"))

        # moto re-reads the whole object for every ranged GET (its S3 key's `value`), so a
        # chunked download pays once per chunk; one GET per file shows how much of the gap
        # is that (real S3 serves ranges independently).
        def tg_one_get():
            drop_dir(dest("tg"))
            return run([args.engine, "fetch", manifest, "--cache", dest("tg"), "--reserve", "0", *opts, *extra,
                        "--chunk-size", str(args.s3_big_mib * MIB)])[0]
        rows.append(("taintgate", "verified, one GET per file (chunk = file)",
                     median_runs("s3 taintgate one GET per file", args.repeats, tg_one_get)))
        drop_dir(dest("tg"))

        def comp(tool, cmd):
            raw, ver = [], []
            for i in range(args.repeats):
                drop_dir(dest(tool))
                os.makedirs(dest(tool), exist_ok=True)
                dt, _ = run(cmd, env=env)
                ht, _ = openssl_hash(dest(tool))
                log(f"  s3 {tool} run {i + 1}: download {dt:.2f} s + hash {ht:.2f} s")
                raw.append(dt)
                ver.append(dt + ht)
            drop_dir(dest(tool))
            rows.append((tool, "download only", statistics.median(raw)))
            rows.append((tool, "+ openssl sha256", statistics.median(ver)))

        if os.path.exists(s5cmd):
            comp("s5cmd", [s5cmd, "--endpoint-url", moto.endpoint, "cp", "s3://bench/*", dest("s5cmd") + "/"])
        if shutil.which("rclone"):
            comp("rclone", ["rclone", "copy", f":s3,provider=Other,endpoint='{moto.endpoint}',access_key_id=testing,secret_access_key=testing:bench",
                            dest("rclone"), "--transfers", "16", "--multi-thread-streams", "16"])
    finally:
        moto.stop()
    return rows


def print_table(rows, total, title):
    rows = [r if len(r) == 4 else (*r, None) for r in rows]
    tg = next((r[2] for r in rows if r[0] == "taintgate" and r[1] == "verified (inline)"), None)
    print(f"\n### {title}: {total / GIB:.2f} GiB, median of runs\n")
    print("| tool | mode | seconds | GB/s | ratio vs taintgate verified | CPU seconds |")
    print("|---|---|---:|---:|---:|---:|")
    for tool, mode, t, cpu in rows:
        ratio = f"{t / tg:.2f}x" if tg else "-"
        cpu_s = "-" if cpu is None else f"{cpu:.1f}"
        print(f"| {tool} | {mode} | {t:.2f} | {total / t / 1e9:.2f} | {ratio} | {cpu_s} |")


if __name__ == "__main__":
    main()
