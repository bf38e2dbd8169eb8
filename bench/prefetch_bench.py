#!/usr/bin/env python3
"""Loopback benchmark of taintgate's bundle prefetch (`taintgate bundle fetch`) against
rclone, aria2c, curl (HTTP, nginx origin) and s5cmd, rclone (S3, s3s-fs origin; moto with
--s3-server moto).

taintgate runs twice per round: on a manifest with whole-file digests only (one in-order
hasher per file) and on one with 16 MiB chunk digests (`bundle create`'s default; every
chunk verified as it arrives, on any core).

Competitors do not verify what they download, so each is reported raw and "verified":
raw download time plus the fastest available sha256 pass over what it wrote
(`openssl dgst -sha256`, one process per file, all cores). taintgate verifies inline.

Everything lives under --data (default /tmp/tg-bench) and --dest (default /dev/shm/tg-bench,
a tmpfs, so every tool writes to memory and the disk is not what is measured; taintgate
still fsyncs every blob). Medians of --repeats runs are reported.

A competitor that is not installed gets a "not installed" row (and a warning), never a
silently missing one. Every tool's output, HTTP and S3, is hashed and checked against the
manifest; a wrong or missing file fails the run naming the tool.

`--small` is a smoke test (tiny data set, one command to prove every invocation works); its
figures mean nothing.
"""

import argparse
import concurrent.futures
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
import urllib.request

MIB = 1 << 20
GIB = 1 << 30

NOT_INSTALLED = "not installed"


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
    """Incompressible data fast: AES-CTR keystream from openssl (os.urandom without it)."""
    if os.path.exists(path) and os.path.getsize(path) == size:
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    if not shutil.which("openssl"):
        with open(tmp, "wb") as out:
            left = size
            while left:
                chunk = os.urandom(min(left, 8 * MIB))
                out.write(chunk)
                left -= len(chunk)
        os.rename(tmp, path)
        return
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
    (user + system, all its threads) are left in LAST_CPU, split in LAST_USER and LAST_SYS,
    and its peak resident memory in MiB in LAST_RSS (GNU time's %M; None without it)."""
    global LAST_CPU, LAST_USER, LAST_SYS, LAST_RSS
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    rss_file = None
    if os.path.exists("/usr/bin/time"):
        fd, rss_file = tempfile.mkstemp(prefix="tg-bench-rss-")
        os.close(fd)
        cmd = ["/usr/bin/time", "-f", "%M", "-o", rss_file, *cmd]
    t = time.perf_counter()
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)
    dt = time.perf_counter() - t
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    LAST_USER = ru1.ru_utime - ru0.ru_utime
    LAST_SYS = ru1.ru_stime - ru0.ru_stime
    LAST_CPU = LAST_USER + LAST_SYS
    LAST_RSS = None
    if rss_file:
        try:
            with open(rss_file) as f:
                LAST_RSS = int(f.read().strip().splitlines()[-1]) / 1024
        except (OSError, ValueError, IndexError):
            pass
        os.unlink(rss_file)
    if r.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({r.returncode}): {r.stderr.decode()[-2000:]}")
    return dt, r.stdout


LAST_CPU = LAST_USER = LAST_SYS = 0.0
LAST_RSS = None


def proc_stat(pid):
    """(ppid, utime + stime in clock ticks) of one process from /proc/<pid>/stat, or None
    when it is gone (it may exit between listing /proc and reading it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            line = f.read()
    except OSError:
        return None
    # comm (field 2) is in parentheses and may itself hold spaces or ')'; the fields after
    # the last ')' start at field 3 (state): ppid is field 4, utime 14, stime 15.
    rest = line[line.rfind(b")") + 1:].split()
    try:
        return int(rest[1]), int(rest[11]) + int(rest[12])
    except (IndexError, ValueError):
        return None


def tree_cpu_snapshot(master):
    """{pid: utime + stime ticks} of a master process and its direct children (nginx's
    workers), for `cpu_delta`."""
    snap = {}
    st = proc_stat(master)
    if st:
        snap[master] = st[1]
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != master:
            st = proc_stat(name)
            if st and st[0] == master:
                snap[int(name)] = st[1]
    return snap


def cpu_delta(before, after):
    """CPU seconds spent between two `tree_cpu_snapshot`s. A process that appeared in
    between counts from zero (it started inside the window); one that vanished counts
    nothing, since what it used after the first snapshot can no longer be read (nginx
    replaces a worker only when one dies, so this is not expected on a healthy run)."""
    ticks = sum(max(0, t - before.get(pid, 0)) for pid, t in after.items())
    return ticks / os.sysconf("SC_CLK_TCK")


def py_hash(root):
    """sha256 of every file under root with Python's hashlib (it releases the GIL, so one
    thread per core), for checking outputs when openssl is not installed. Returns
    (seconds, {relpath: digest})."""
    def one(path):
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(8 * MIB):
                h.update(chunk)
        return os.path.relpath(path, root), h.hexdigest()
    global LAST_CPU
    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as ex:
        digests = dict(ex.map(one, all_files(root)))
    LAST_CPU = 0.0
    return time.perf_counter() - t, digests


def openssl_hash(root):
    """Fastest available sha256 pass: openssl, one process per file, all cores. Returns
    (seconds, {relpath: digest}). Without openssl, hashlib's digests (for the check only;
    the "+ openssl sha256" rows then say it is not installed)."""
    if not shutil.which("openssl"):
        return py_hash(root)
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


def serial_hash_floor(root, repeats=3):
    """sha256 of the data set's largest file by one `openssl dgst` alone, from the page cache:
    (path, bytes, median wall s, median user cpu-s), or None without openssl.

    SHA-256 chains every 64-byte block to the one before, so one file is hashed on one core,
    whatever the tool and however many cores the machine has. openssl's user CPU time is the
    compute alone (its reads from the page cache are system time, which a tool hashing the
    bytes it received does not pay), so no verified download of this data set can finish in
    less: a floor set by the CPU, not by any engine. The stretch target (verified taintgate
    no slower than the fastest unverified download) is out of reach for any tool on a
    machine where this floor is above that download's time."""
    if not shutil.which("openssl"):
        return None
    big = max(all_files(root), key=os.path.getsize)
    walls, users = [], []
    for _ in range(repeats):
        u0 = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
        t = time.perf_counter()
        subprocess.run(["openssl", "dgst", "-sha256", big], stdout=subprocess.DEVNULL, check=True)
        walls.append(time.perf_counter() - t)
        users.append(resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - u0)
    return big, os.path.getsize(big), statistics.median(walls), statistics.median(users)


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


def manifest_digests(text):
    """{path: sha256} of a manifest written by `taintgate bundle create`."""
    expected, cur = {}, None
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("- path:"):
            cur = s.split(":", 1)[1].strip()
        elif s.startswith("sha256:") and cur:
            expected[cur] = s.split(":", 1)[1].strip()
    if not expected:
        raise RuntimeError("the manifest lists no file digests")
    return expected


def check(label, expected, digests):
    """Fail the run, naming the tool, when what it wrote differs from the manifest."""
    bad = [p for p, d in expected.items() if digests.get(p) != d]
    if bad:
        missing = [p for p in bad if p not in digests]
        raise RuntimeError(f"{label}: {len(bad)} of {len(expected)} files wrong or missing "
                           f"({len(missing)} missing), e.g. {bad[:3]}; it wrote {sorted(digests)[:3]}...")


def create_manifest(engine, root, base_uri, path, chunks=False):
    """`taintgate bundle create` (manifest to a file; its sha256 goes to stderr), with
    whole-file digests only or (`chunks`) also the default 16 MiB chunk digests. Returns
    the expected digests."""
    run([engine, "bundle", "create", root, "--base-uri", base_uri, "--output", path,
         *([] if chunks else ["--no-chunk-digests"])])
    with open(path) as f:
        return manifest_digests(f.read())


def fetch_cmd(engine, manifest, cache, *flags):
    """`taintgate bundle fetch` with `--reserve 0`, as the bench always ran the engine: no
    free-space reserve on the tmpfs destination, so the preflight never refuses a run."""
    return [engine, "bundle", "fetch", manifest, "--cache", cache, "--reserve", "0", *flags]


def check_fetch_output(out):
    """`taintgate bundle fetch` exits 0 only after verifying, and says so on stdout."""
    if not out.startswith(b"verified:"):
        raise RuntimeError(f"taintgate bundle fetch printed {out[:200]!r}, not a verified report")


def without_flags(argv, names):
    """argv minus `--name VALUE` / `--name=VALUE` for each name: a row that sets one of these
    itself (the sweep, one GET per file) must not get a clap 'used multiple times' error
    from --engine-args, nor have its own value overridden."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in names:
            skip = True
        elif a.split("=", 1)[0] in names:
            pass
        else:
            out.append(a)
    return out


def not_installed(tool, why="", rows=f"its rows say '{NOT_INSTALLED}'"):
    log(f"warning: {tool} is not installed{why}; {rows}")


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
        if not os.path.exists(nginx):
            raise RuntimeError("nginx is not installed (the HTTP origin); run bench/run.sh, which installs it")
        self.proc = subprocess.Popen([nginx, "-c", conf, "-p", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_tcp(self.port)

    def url(self, path=""):
        return f"http://127.0.0.1:{self.port}/{path}"

    def cpu_snapshot(self):
        """The master's and workers' CPU ticks so far (`daemon off`, so the process we
        started is the master). The origin shares the cores with the tool it serves, so
        its CPU bounds how fast any tool can be on this machine."""
        return tree_cpu_snapshot(self.proc.pid)

    def stop(self):
        self.proc.send_signal(signal.SIGQUIT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def profile_run(args, work, cmd):
    """One more taintgate run under `perf record` (call graphs off: self time per symbol is
    the question), then where its CPU went: by binary (kernel, taintgate, libc) and by
    symbol. Prints a note instead when perf is missing or not allowed."""
    perf = shutil.which("perf")
    if not perf:
        log("profile: perf is not installed (Debian linux-perf); skipped")
        return
    data = os.path.join(work, "perf.data")
    drop_dir(cmd[cmd.index("--cache") + 1])
    r = subprocess.run([perf, "record", "-F", "999", "-o", data, "--", *cmd],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if r.returncode != 0:
        log(f"profile: perf record failed: {r.stderr.decode()[-500:]}")
        return
    print("\n### Where taintgate's CPU goes (chunk digests, perf record -F 999, self time)\n")
    for sort, limit in (("dso", 8), ("dso,symbol", 15)):
        rep_ = subprocess.run([perf, "report", "-i", data, "--no-children", "--sort", sort, "--stdio",
                               "--percent-limit", "1"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        lines = [l.rstrip().rstrip("- ").rstrip() for l in rep_.stdout.decode(errors="replace").splitlines()
                 if l.strip() and not l.startswith("#")]
        print("```")
        print("\n".join(lines[:limit]))
        print("```")
    drop_dir(cmd[cmd.index("--cache") + 1])


class S3Origin:
    """An S3 server on loopback: `port`, `proc` and the credentials it accepts."""
    port = 0
    proc = None

    @property
    def endpoint(self):
        return f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.proc.kill()
        self.proc.wait()


class S3sFs(S3Origin):
    """s3s-fs (crates.io; scripts/install-test-deps-stores.sh installs it): S3 over a
    directory, SigV4 checked, ranged GETs served from the file without copying it."""
    KEY, SECRET = "taintgate-bench", "taintgate-bench-secret"

    def __init__(self, root):
        here = os.path.dirname(os.path.abspath(__file__))
        installer = os.path.join(os.path.dirname(here), "scripts", "install-test-deps-stores.sh")
        binary = subprocess.run(["bash", installer, "--print-path", "s3s-fs"], stdout=subprocess.PIPE,
                                check=True).stdout.decode().strip()
        if not os.access(binary, os.X_OK):
            raise RuntimeError(f"s3s-fs not installed ({binary}); run scripts/install-test-deps-stores.sh "
                               "or pass --s3-server moto / --skip-s3")
        drop_dir(root)
        os.makedirs(os.path.join(root, "bench"))
        self.port = free_port()
        self.proc = subprocess.Popen([binary, "--host", "127.0.0.1", "--port", str(self.port),
                                      "--access-key", self.KEY, "--secret-key", self.SECRET, root],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_tcp(self.port)


class Moto(S3Origin):
    KEY, SECRET = "testing", "testing"

    def __init__(self, venv):
        self.port = free_port()
        if not os.path.exists(os.path.join(venv, "bin", "moto_server")):
            raise RuntimeError(f"moto_server not in {venv} (the S3 origin); run bench/run.sh, or pass --skip-s3")
        self.proc = subprocess.Popen([os.path.join(venv, "bin", "moto_server"), "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_tcp(self.port)


# rclone's "tuned" HTTP variant: more parallel files, more streams per big file, and
# multi-thread download from 64 MiB (defaults: 4 transfers, 8 checkers, 4 streams, 250 MiB).
#
# The set used until now also had `--http-no-head` (and `--buffer-size 16M`, rclone's
# default, so a no-op), and `--http-no-head` is what made it 3.5x slower than the defaults
# (14.6 s vs 4.15 s in the README table). Without HEAD requests the http backend does not
# know any file's size (it only reads the links of nginx's index), and rclone 1.60 then
# copies every file as a stream of unknown length (`-vv` logs "Copied (Rcat, new)" and an
# md5 of the stream, not "Starting multi-thread copy"): the 3 GiB file comes down over one
# connection and is hashed on the way, whatever --multi-thread-streams says. Measured by
# hand on loopback nginx on the 2-core VM (rclone 1.60.1, median of 5 runs, the VM loaded by
# other work): 512 MiB + 128 x 4 MiB took 2.08 s with the defaults, 5.97 s with the old
# set and 1.83 s with the old set minus `--http-no-head`, i.e. the flags below; on 512 MiB
# + 32 x 4 MiB, `--http-no-head` alone took 3.70 s against the defaults' 1.38 s. In four such comparisons (two data sets) these
# flags beat the defaults' median three times (1.07 vs 1.38, 1.83 vs 2.08, 1.84 vs 1.91 s)
# and lost once (1.40 vs 1.22 s); `--multi-thread-streams 8` and `--transfers 8` variants
# were no better. On two loaded cores every set without `--http-no-head` is within the
# noise of the defaults: the loopback run is CPU-bound, so more parallelism buys little.
RCLONE_TUNED = ["--transfers", "16", "--checkers", "16", "--multi-thread-streams", "16", "--multi-thread-cutoff", "64M"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", required=True,
                    help="the taintgate binary (target/release/taintgate); runs `bundle create` and `bundle fetch`")
    ap.add_argument("--data", default=None, help="data set directory [/tmp/tg-bench; /tmp/tg-bench-small with --small]")
    ap.add_argument("--dest", default="/dev/shm/tg-bench")
    ap.add_argument("--repeats", type=int, default=int(os.environ.get("REPEATS", "3")))
    ap.add_argument("--small", action="store_true",
                    help="smoke test: 64 MiB + 8 x 1 MiB over HTTP, 8 MiB + 4 x 1 MiB over S3, no warm-up round, "
                         "page cache left alone, 256 MiB fill-rate probe; proves every command works, measures nothing")
    ap.add_argument("--big-gib", type=float, default=None, help="HTTP big file [3; 0.0625 with --small]")
    ap.add_argument("--small-count", type=int, default=None, help="HTTP small files [200; 8 with --small]")
    ap.add_argument("--small-mib", type=int, default=None, help="HTTP small file MiB [5; 1 with --small]")
    ap.add_argument("--s3-big-mib", type=int, default=None, help="S3 big file MiB [3072; 8 with --small]")
    ap.add_argument("--s3-small-count", type=int, default=None, help="S3 small files [16; 4 with --small]")
    ap.add_argument("--s3-small-mib", type=int, default=None, help="S3 small file MiB [64; 1 with --small]")
    ap.add_argument("--s3-server", choices=("s3s", "moto"), default="s3s",
                    help="S3 origin: s3s-fs (serves ranges from the file; scripts/install-test-deps-stores.sh) "
                         "or moto (copies the object on every ranged GET) [s3s]")
    ap.add_argument("--profile", action="store_true",
                    help="after the HTTP rounds, one more taintgate run (chunk digests) under `perf record`, "
                         "and where its CPU went")
    ap.add_argument("--skip-s3", action="store_true")
    ap.add_argument("--warmup", type=int, choices=(0, 1), default=None, help="run one discarded round first [1; 0 with --small]")
    ap.add_argument("--drop-caches", type=int, choices=(0, 1), default=None,
                    help="drop the page cache before the run (needs root; see drop_page_cache) [1; 0 with --small]")
    ap.add_argument("--only", default="", help="comma list of tools to run (debug)")
    ap.add_argument("--engine-args", default="", help="extra args for `taintgate bundle fetch` (tuning)")
    ap.add_argument("--sweep", default="",
                    help="tune the engine's defaults: space-separated CONCURRENCY:FILE_CONCURRENCY:CHUNK_MIB "
                         "variants, each run as one more taintgate row in the same round-robin")
    args = ap.parse_args()
    defaults = dict(data=("/tmp/tg-bench", "/tmp/tg-bench-small"), big_gib=(3.0, 1 / 16), small_count=(200, 8),
                    small_mib=(5, 1), s3_big_mib=(3072, 8), s3_small_count=(16, 4), s3_small_mib=(64, 1),
                    warmup=(1, 0), drop_caches=(1, 0))
    for k, (full, small) in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, small if args.small else full)
    fill_size = 256 * MIB if args.small else GIB
    if not os.access(args.engine, os.X_OK):
        sys.exit(f"error: --engine {args.engine} is not an executable (build it: cargo build --release -p taintgate)")
    venv = os.path.dirname(os.path.dirname(os.path.abspath(sys.executable)))
    only = set(filter(None, args.only.split(",")))
    want = lambda t: not only or t in only
    extra = args.engine_args.split()
    have_openssl = bool(shutil.which("openssl"))
    if not have_openssl:
        not_installed("openssl", " (outputs are still checked, with Python's hashlib)",
                      f"the '+ openssl sha256' rows say 'openssl {NOT_INSTALLED}' and the hash overlap is not measured")

    http_root = os.path.join(args.data, "http")
    make_dataset(http_root, int(args.big_gib * GIB), args.small_count, args.small_mib * MIB)
    total = sum(os.path.getsize(f) for f in all_files(http_root))
    log(f"data set: {total / GIB:.2f} GiB in {len(all_files(http_root))} files under {http_root}")
    os.makedirs(args.dest, exist_ok=True)
    work = tempfile.mkdtemp(prefix="tg-bench-work-")
    manifest = os.path.join(work, "manifest.yaml")
    manifest_chunks = os.path.join(work, "manifest-chunks.yaml")

    nginx = Nginx(http_root, os.path.join(work, "nginx"))
    rows = []  # (tool, mode, seconds or a note, cpu seconds or None, origin cpu seconds or None)
    raws = {}  # "tool mode" -> median download-only seconds, for competitors
    raw_samples = {}  # "tool mode" -> its samples, for the fastest one's CPU floor
    hash_only = None
    serial = None
    # (tool, mode) -> list of (download wall, download cpu, hash wall, hash cpu, origin cpu
    # during the download)
    samples = {}
    hash_only_samples, warm_samples, fill_samples = [], [], []
    try:
        # Expected digests, for checking what every tool wrote.
        expected = create_manifest(args.engine, http_root, nginx.url(""), manifest)
        create_manifest(args.engine, http_root, nginx.url(""), manifest_chunks, chunks=True)
        # Free memory, then warm the origin's page cache so every tool reads from memory.
        if args.drop_caches:
            drop_page_cache()
        openssl_hash(http_root)

        dest = lambda tool: os.path.join(args.dest, tool)

        # Every tool as (name, mode, command, output dir, verifies inline). Repeats run
        # round-robin so load from anything else on the machine hits every tool alike.
        # A tool that is not installed gets its rows in `missing` instead.
        tools, missing = [], []
        if want("taintgate"):
            tools.append(("taintgate", "verified (inline)",
                          lambda: fetch_cmd(args.engine, manifest, dest("tg"), *extra),
                          os.path.join(dest("tg"), "bundles", "bundle"), True))
            tools.append(("taintgate", "verified, chunk digests (16 MiB)",
                          lambda: fetch_cmd(args.engine, manifest_chunks, dest("tg"), *extra),
                          os.path.join(dest("tg"), "bundles", "bundle"), "sweep"))
            sweep_extra = without_flags(extra, {"--concurrency", "--file-concurrency", "--chunk-size"})
            for v in args.sweep.split():
                c, fc, mib = (int(x) for x in v.split(":"))
                tools.append(("taintgate", f"verified, concurrency {c}, file {fc}, chunk {mib} MiB",
                              lambda c=c, fc=fc, mib=mib: fetch_cmd(
                                  args.engine, manifest, dest("tg"),
                                  "--concurrency", str(c), "--file-concurrency", str(fc),
                                  "--chunk-size", str(mib * MIB), *sweep_extra),
                              os.path.join(dest("tg"), "bundles", "bundle"), "sweep"))
        if want("rclone"):
            if shutil.which("rclone"):
                tools.append(("rclone", "defaults",
                              lambda: ["rclone", "copy", "--http-url", nginx.url(""), ":http:", dest("rclone")],
                              dest("rclone"), False))
                tools.append(("rclone", "tuned (16 transfers, 16 streams from 64M)",
                              lambda: ["rclone", "copy", "--http-url", nginx.url(""), ":http:", dest("rclone"),
                                       *RCLONE_TUNED],
                              dest("rclone"), False))
            else:
                not_installed("rclone")
                missing += [("rclone", "defaults"), ("rclone", "tuned")]
        if want("aria2c"):
            if shutil.which("aria2c"):
                urls = os.path.join(work, "aria2.txt")
                with open(urls, "w") as f:
                    for p in expected:
                        f.write(f"{nginx.url(p)}\n  out={p}\n")
                tools.append(("aria2c", "-x16 -j16",
                              lambda: ["aria2c", "-x16", "-s16", "-j16", "-i", urls, "-d", dest("aria2c"),
                                       "--file-allocation=none", "--allow-overwrite=true", "--auto-file-renaming=false",
                                       "--console-log-level=warn", "--summary-interval=0", "--download-result=hide"],
                              dest("aria2c"), False))
            else:
                not_installed("aria2c")
                missing.append(("aria2c", "-x16 -j16"))
        if want("curl"):
            if shutil.which("curl"):
                cfg = os.path.join(work, "curl.cfg")
                with open(cfg, "w") as f:
                    for p in expected:
                        f.write(f'url = "{nginx.url(p)}"\noutput = "{os.path.join(dest("curl"), p)}"\n')
                tools.append(("curl", "--parallel 16",
                              lambda: ["curl", "-sS", "-f", "--parallel", "--parallel-max", "16", "--create-dirs", "-K", cfg],
                              dest("curl"), False))
            else:
                not_installed("curl")
                missing.append(("curl", "--parallel 16"))

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
            fill_samples.append(fill_rate(args.dest, fill_size))
            log(f"  round {rep + 1}: page-cache fill rate {fill_samples[-1]:.2f} GB/s")
            # Each round starts one place further down the list. The first run after the
            # fill-rate probe (which writes and frees a GiB) pays for fresh memory: the same
            # taintgate settings took 3.4-4.4 s first in a round and 3.1-3.3 s later in it.
            # A fixed order put that cost on the same tool every round; rotating spreads it,
            # so each tool's median is taken from runs in different places.
            k = rep % len(tools)
            for tool, mode, cmd_fn, out_dir, inline in tools[k:] + tools[:k]:
                base = dest("tg") if tool == "taintgate" else dest(tool)
                drop_dir(base)
                os.makedirs(base, exist_ok=True)
                o0 = nginx.cpu_snapshot()
                dt, out = run(cmd_fn())
                dcpu, duser, dsys, drss = LAST_CPU, LAST_USER, LAST_SYS, LAST_RSS
                ocpu = cpu_delta(o0, nginx.cpu_snapshot())
                if tool == "taintgate":
                    check_fetch_output(out)
                ht, dg = openssl_hash(out_dir)  # also checks what was written
                hcpu = LAST_CPU
                check(f"HTTP {tool} {mode}", expected, dg)
                if inline == "sweep":
                    ht, hcpu = 0.0, 0.0
                elif inline:
                    hash_only_samples.append(ht)
                    ht, hcpu = 0.0, 0.0
                    wt, out = run(cmd_fn())  # warm restart: everything cached
                    check_fetch_output(out)
                    warm_samples.append(wt)
                samples.setdefault((tool, mode), []).append((dt, dcpu, ht, hcpu, ocpu, duser, dsys, drss))
                log(f"  run {rep + 1} {tool} {mode}: download {dt:.2f} s ({dcpu:.1f} cpu-s, origin {ocpu:.2f} cpu-s)"
                    + ("" if inline else f" + hash {ht:.2f} s ({hcpu:.1f} cpu-s)"))
                drop_dir(base)

        med = lambda xs: statistics.median(xs)
        # User / system CPU seconds and peak RSS (MiB) of the download itself.
        usr = lambda xs: (med([x[5] for x in xs]), med([x[6] for x in xs]),
                          max((x[7] for x in xs if x[7] is not None), default=None))
        for (tool, mode), xs in samples.items():
            # The origin only works during the download, so a "+ openssl" row shows the
            # download's origin CPU too.
            ocpu = med([x[4] for x in xs])
            if tool == "taintgate" and mode.startswith("verified, "):
                rows.append((tool, mode, med([x[0] for x in xs]), med([x[1] for x in xs]), ocpu, *usr(xs)))
            elif tool == "taintgate":
                rows.append((tool, mode, med([x[0] for x in xs]), med([x[1] for x in xs]), ocpu, *usr(xs)))
                rows.append((tool, "warm restart (all cached)", med(warm_samples), None, None))
            else:
                rows.append((tool, f"{mode}, download only", med([x[0] for x in xs]), med([x[1] for x in xs]), ocpu,
                             *usr(xs)))
                if have_openssl:
                    rows.append((tool, f"{mode} + openssl sha256", med([x[0] + x[2] for x in xs]),
                                 med([x[1] + x[3] for x in xs]), ocpu))
                else:
                    rows.append((tool, f"{mode} + openssl sha256", "openssl " + NOT_INSTALLED, None, None))
                raws[f"{tool} {mode}"] = med([x[0] for x in xs])
                raw_samples[f"{tool} {mode}"] = xs
        rows += [(tool, mode, NOT_INSTALLED, None, None) for tool, mode in missing]
        if hash_only_samples and have_openssl:
            hash_only = med(hash_only_samples)
        # Measured alone, after every round, with the origin's files in the page cache.
        serial = serial_hash_floor(http_root)
        if args.profile:
            profile_run(args, work, fetch_cmd(args.engine, manifest_chunks, dest("tg"), *extra))
    finally:
        nginx.stop()

    s3rows = []
    if not args.skip_s3:
        s3rows = s3_bench(args, venv, work, extra, want)

    print_table(rows, total, "HTTP (nginx on loopback)", origin_col=True)
    tg_t = next((r[2] for r in rows if r[0] == "taintgate" and r[1] == "verified (inline)"), None)
    if tg_t and raws and hash_only:
        best_raw = min(raws.values())
        print(f"\nhash overlap: taintgate {tg_t:.2f} s / max(fastest download-only {best_raw:.2f} s, "
              f"openssl hash-only {hash_only:.2f} s) = {tg_t / max(best_raw, hash_only):.2f}")
        # The run is CPU-bound and the origin shares the cores, so no tool can finish faster
        # than (its CPU + the origin's CPU) / cores: that floor says how much of the overlap
        # target this run's CPU left reachable, and wall / floor how well each tool packed
        # its work onto the cores.
        tg_runs = samples.get(("taintgate", "verified (inline)"), [])
        cores = os.cpu_count() or 1
        floor = lambda cpu, ocpu: (cpu + ocpu) / cores
        tg_cpu, tg_ocpu = (statistics.median(x[i] for x in tg_runs) for i in (1, 4))
        tg_floor = floor(tg_cpu, tg_ocpu)
        print(f"CPU floor: (taintgate {tg_cpu:.2f} cpu-s + origin {tg_ocpu:.2f} cpu-s) / {cores} cores = "
              f"{tg_floor:.2f} s; taintgate reached {tg_floor / tg_t:.2f} of it (packing {tg_floor / tg_t:.0%}); "
              f"the best overlap this run's CPU allows = {tg_floor:.2f} / max(fastest download-only {best_raw:.2f} s, "
              f"hash-only {hash_only:.2f} s) = {tg_floor / max(best_raw, hash_only):.2f}")
        best_key = min(raws, key=raws.get)
        b_cpu, b_ocpu = (statistics.median(x[i] for x in raw_samples[best_key]) for i in (1, 4))
        b_floor = floor(b_cpu, b_ocpu)
        print(f"CPU floor, fastest download-only ({best_key}): ({b_cpu:.2f} cpu-s + origin {b_ocpu:.2f} cpu-s) / "
              f"{cores} cores = {b_floor:.2f} s; it reached {b_floor / best_raw:.2f} of it "
              f"(packing {b_floor / best_raw:.0%})")
        # The same ratios round by round, next to the machine's memory state in that round.
        raw_runs = [xs for (tool, mode), xs in samples.items() if tool != "taintgate"]
        for r, fill in enumerate(fill_samples):
            if r < len(tg_runs) and all(r < len(xs) for xs in raw_runs):
                best = min(xs[r][0] for xs in raw_runs)
                tg_r = tg_runs[r]
                f_r = floor(tg_r[1], tg_r[4])
                print(f"  round {r + 1}: page-cache fill {fill:.2f} GB/s, taintgate {tg_r[0]:.2f} s / "
                      f"fastest download-only {best:.2f} s = {tg_r[0] / max(best, hash_only):.2f}; "
                      f"CPU floor ({tg_r[1]:.2f} + origin {tg_r[4]:.2f} cpu-s) / {cores} = {f_r:.2f} s, "
                      f"packing {f_r / tg_r[0]:.0%}, floor-bound overlap {f_r / max(best, hash_only):.2f}")
    elif tg_t and not have_openssl:
        print("\nhash overlap: not measured (openssl not installed)")
    chunk_runs = samples.get(("taintgate", "verified, chunk digests (16 MiB)"), [])
    if chunk_runs and raws:
        best_key = min(raws, key=raws.get)
        best = raws[best_key]
        c_t = statistics.median(x[0] for x in chunk_runs)
        c_cpu, c_ocpu = (statistics.median(x[i] for x in chunk_runs) for i in (1, 4))
        cores = os.cpu_count() or 1
        c_floor = (c_cpu + c_ocpu) / cores
        file_part = f"; file digests {tg_t:.2f} s = {tg_t / best:.2f}x" if tg_t else ""
        print(f"\nchunk digests vs the fastest unverified download ({best_key} {best:.2f} s): taintgate "
              f"{c_t:.2f} s = {c_t / best:.2f}x (target <= 1.10x: {'met' if c_t / best <= 1.10 else 'not met'})"
              + file_part)
        b_cpu, b_ocpu = (statistics.median(x[i] for x in raw_samples[best_key]) for i in (1, 4))
        print(f"CPU floor with chunk digests: (taintgate {c_cpu:.2f} cpu-s + origin {c_ocpu:.2f} cpu-s) / {cores} "
              f"cores = {c_floor:.2f} s, {c_floor / best:.2f}x the fastest download; that download's own floor "
              f"({b_cpu:.2f} + {b_ocpu:.2f} cpu-s) / {cores} = {(b_cpu + b_ocpu) / cores:.2f} s. "
              f"Verifying adds the sha256 CPU on top of what the download costs, so on {cores} busy cores no "
              f"verified run can beat {c_floor:.2f} s with this engine's CPU")
        if serial:
            # The same floor for any tool: the fastest download's own CPU and its origin's,
            # plus the sha256 compute of every byte (openssl's user time per byte, measured
            # alone on the largest file), spread over every core.
            _, s_size, _, s_user = serial
            sha_cpu = total * s_user / s_size
            v_floor = (b_cpu + b_ocpu + sha_cpu) / cores
            print(f"verified floor for any tool: (fastest download {b_cpu:.2f} cpu-s + origin {b_ocpu:.2f} cpu-s + "
                  f"sha256 of {total / GIB:.2f} GiB {sha_cpu:.2f} cpu-s) / {cores} cores = {v_floor:.2f} s = "
                  f"{v_floor / best:.2f}x the fastest download; taintgate with chunk digests {c_t:.2f} s = "
                  f"{c_t / v_floor:.2f}x that floor")
    if serial and raws:
        path, size, wall, user = serial
        best_key = min(raws, key=raws.get)
        if user >= raws[best_key]:
            verdict = f"out of reach on this machine for any tool that verifies ({user:.2f} s >= {raws[best_key]:.2f} s)"
        else:
            verdict = "not ruled out by this floor"
        if tg_t:
            verdict += f"; taintgate verified {tg_t:.2f} s = {tg_t / raws[best_key]:.2f}x that download"
        print(f"serial-hash floor: sha256 of the largest file ({os.path.basename(path)}, {size / GIB:.2f} GiB) on one "
              f"core, openssl alone: {user:.2f} cpu-s of compute ({wall:.2f} s wall with its page-cache reads), "
              f"{size / user / 1e9:.2f} GB/s; SHA-256 is a chain, so no verified download of this data set finishes "
              f"sooner on any number of cores. Stretch target (verified <= fastest download-only, {best_key} "
              f"{raws[best_key]:.2f} s): {verdict}")
    if s3rows:
        s3_total = (args.s3_big_mib + args.s3_small_count * args.s3_small_mib) * MIB
        if args.s3_server == "moto":
            title = "S3 (moto on loopback; moto caps near 30 MB/s, so this measures request overhead, not throughput)"
        else:
            title = "S3 (s3s-fs on loopback, SigV4 checked, ranges served from the file)"
        print_table(s3rows, s3_total, title, origin_col=True)
        verified = [r for r in s3rows if r[0] != "taintgate" and "openssl" in r[1] and not isinstance(r[2], str)]
        for tg_mode in ("verified (inline)", "verified, chunk digests (16 MiB)"):
            tg = next((r[2] for r in s3rows if r[0] == "taintgate" and r[1] == tg_mode), None)
            if tg and verified:
                best = min(verified, key=lambda r: r[2])
                print(f"S3: taintgate {tg_mode} {tg:.2f} s vs fastest verified competitor ({best[0]} {best[1]}) "
                      f"{best[2]:.2f} s: {best[2] / tg:.2f}x faster (target >= 1.3x)")
    if args.small:
        print("\n(--small: a smoke test of every command on a tiny data set; these figures mean nothing)")
    shutil.rmtree(work, ignore_errors=True)


def put_object(url, path):
    """PUT one file into moto (setup, not measured). Content-Type matters: without it moto
    parses the body as a form (very slow)."""
    with open(path, "rb") as f:
        req = urllib.request.Request(url, data=f, method="PUT", headers={
            "Content-Type": "application/octet-stream", "Content-Length": str(os.path.getsize(path))})
        urllib.request.urlopen(req).close()


def s3_bench(args, venv, work, extra, want):
    root = os.path.join(args.data, "s3")
    make_dataset(root, args.s3_big_mib * MIB, args.s3_small_count, args.s3_small_mib * MIB)
    moto = Moto(venv) if args.s3_server == "moto" else S3sFs(os.path.join(work, "s3s-root"))
    rows = []
    # A CA bundle set for the real cloud breaks rclone's plain-HTTP loopback client.
    base_env = {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}
    env = dict(base_env, AWS_ACCESS_KEY_ID=moto.KEY, AWS_SECRET_ACCESS_KEY=moto.SECRET, AWS_REGION="us-east-1",
               AWS_DEFAULT_REGION="us-east-1")
    s5cmd = os.path.join(venv, "bin", "s5cmd")
    rclone_remote = (f":s3,provider=Other,endpoint='{moto.endpoint}',access_key_id={moto.KEY},"
                     f"secret_access_key={moto.SECRET}:bench")
    try:
        if args.s3_server == "moto":
            urllib.request.urlopen(urllib.request.Request(f"{moto.endpoint}/bench", method="PUT")).close()
            for f in all_files(root):
                put_object(f"{moto.endpoint}/bench/{os.path.relpath(f, root)}", f)
        else:
            # Uploaded through the server (SigV4, one PUT per file up to 5 GiB) so it
            # records each object's ETag, as S3 does; not measured.
            if not shutil.which("rclone"):
                raise RuntimeError("rclone is needed to upload the S3 data set into s3s-fs; run bench/run.sh")
            run(["rclone", "copy", root, rclone_remote, "--s3-upload-cutoff", "5G", "--transfers", "4"], env=env)
        manifest = os.path.join(work, "s3-manifest.yaml")
        manifest_chunks = os.path.join(work, "s3-manifest-chunks.yaml")
        expected = create_manifest(args.engine, root, "s3://bench", manifest)
        create_manifest(args.engine, root, "s3://bench", manifest_chunks, chunks=True)
        dest = lambda t: os.path.join(args.dest, "s3-" + t)
        opts = ["--opt", f"aws_endpoint={moto.endpoint}", "--opt", "aws_allow_http=true",
                "--opt", f"aws_access_key_id={moto.KEY}", "--opt", f"aws_secret_access_key={moto.SECRET}",
                "--opt", "aws_region=us-east-1"]
        tg_view = os.path.join(dest("tg"), "bundles", "bundle")

        def measure(cmd, **kw):
            """(wall, cpu, origin cpu, user, system, peak RSS MiB) of one download, and its
            stdout. The origin (s3s-fs or moto) shares the cores, as nginx does over HTTP."""
            o0 = tree_cpu_snapshot(moto.proc.pid)
            dt, out = run(cmd, **kw)
            return (dt, LAST_CPU, cpu_delta(o0, tree_cpu_snapshot(moto.proc.pid)), LAST_USER, LAST_SYS,
                    LAST_RSS), out

        def summary(tool, mode, xs):
            med = lambda i: None if any(x[i] is None for x in xs) else statistics.median(x[i] for x in xs)
            return (tool, mode, med(0), med(1), med(2), med(3), med(4),
                    max((x[5] for x in xs if x[5] is not None), default=None))

        def tg_rows(label, mode, cmd):
            xs = []
            for i in range(args.repeats):
                drop_dir(dest("tg"))
                x, out = measure(cmd)
                check_fetch_output(out)
                check(f"S3 taintgate {label}", expected, openssl_hash(tg_view)[1])
                log(f"  s3 taintgate {label} run {i + 1}: {x[0]:.2f} s ({x[1]:.1f} cpu-s, origin {x[2]:.1f} cpu-s)")
                xs.append(x)
            drop_dir(dest("tg"))
            rows.append(summary("taintgate", mode, xs))

        if want("taintgate"):
            tg_rows("verified", "verified (inline)", fetch_cmd(args.engine, manifest, dest("tg"), *opts, *extra))
            tg_rows("chunk digests", "verified, chunk digests (16 MiB)",
                    fetch_cmd(args.engine, manifest_chunks, dest("tg"), *opts, *extra))

        if want("taintgate") and args.s3_server == "moto":
            # moto re-reads the whole object for every ranged GET (its S3 key's `value`), so a
            # chunked download pays once per chunk; one GET per file shows how much of the gap
            # is that (real S3 serves ranges independently).
            one_get = fetch_cmd(args.engine, manifest, dest("tg"), *opts, *without_flags(extra, {"--chunk-size"}),
                                "--chunk-size", str(args.s3_big_mib * MIB))
            tg_rows("one GET per file", "verified, one GET per file (chunk = file)", one_get)

        def comp(tool, cmd):
            """A competitor: download, then hash and check what it wrote against the manifest
            (a wrong or missing file fails the run, as over HTTP)."""
            raw, ver = [], []
            for i in range(args.repeats):
                drop_dir(dest(tool))
                os.makedirs(dest(tool), exist_ok=True)
                x, _ = measure(cmd, env=env)
                ht, dg = openssl_hash(dest(tool))
                check(f"S3 {tool}", expected, dg)
                log(f"  s3 {tool} run {i + 1}: download {x[0]:.2f} s ({x[1]:.1f} cpu-s, origin {x[2]:.1f} cpu-s)"
                    f" + hash {ht:.2f} s")
                raw.append(x)
                ver.append((x[0] + ht, x[1] + LAST_CPU, x[2], None, None, None))
            drop_dir(dest(tool))
            rows.append(summary(tool, "download only", raw))
            rows.append(summary(tool, "+ openssl sha256", ver) if shutil.which("openssl")
                        else (tool, "+ openssl sha256", "openssl " + NOT_INSTALLED))

        if want("s5cmd"):
            if os.path.exists(s5cmd):
                comp("s5cmd", [s5cmd, "--endpoint-url", moto.endpoint, "cp", "s3://bench/*", dest("s5cmd") + "/"])
            else:
                not_installed("s5cmd", f" (looked for {s5cmd})")
                rows.append(("s5cmd", "cp", NOT_INSTALLED))
        if want("rclone"):
            if shutil.which("rclone"):
                comp("rclone", ["rclone", "copy", rclone_remote, dest("rclone"), "--transfers", "16",
                                "--multi-thread-streams", "16"])
            else:
                not_installed("rclone")
                rows.append(("rclone", "copy", NOT_INSTALLED))
    finally:
        moto.stop()
    return rows


def print_table(rows, total, title, origin_col=False):
    """Rows are (tool, mode, seconds[, cpu seconds[, origin cpu seconds[, user, system cpu
    seconds, peak RSS MiB]]]); seconds may be a note ("not installed"). `origin_col` adds
    the origin's CPU during the download (measured for the HTTP origin only)."""
    rows = [(*r, *[None] * (8 - len(r))) for r in rows]
    tg = next((r[2] for r in rows if r[0] == "taintgate" and r[1] == "verified (inline)"), None)
    fmt = lambda x, spec: "-" if x is None else format(x, spec)
    print(f"\n### {title}: {total / GIB:.2f} GiB, median of runs\n")
    print("| tool | mode | seconds | GB/s | ratio vs taintgate verified | CPU seconds | user / kernel | peak RSS MiB |"
          + (" origin CPU seconds |" if origin_col else ""))
    print("|---|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if origin_col else ""))
    for tool, mode, t, cpu, ocpu, user, sys_, rss in rows:
        tail = f" {fmt(ocpu, '.2f')} |" if origin_col else ""
        if isinstance(t, str):
            print(f"| {tool} | {mode} | {t} | - | - | - | - | - |" + tail)
            continue
        ratio = f"{t / tg:.2f}x" if tg else "-"
        split = "-" if user is None else f"{user:.1f} / {sys_:.1f}"
        print(f"| {tool} | {mode} | {t:.2f} | {total / t / 1e9:.2f} | {ratio} | {fmt(cpu, '.1f')} | {split} | "
              f"{fmt(rss, '.0f')} |" + tail)


if __name__ == "__main__":
    main()
