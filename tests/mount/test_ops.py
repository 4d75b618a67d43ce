"""Operating a mount the way operators do: ``mount -t fuse.kvfs`` and an fstab line
(mount.fuse3's ``kvfs SOURCE MOUNTPOINT -o OPTS``), the systemd unit and its
readiness protocol, SIGHUP reopening the log, a daemon detached from its caller
(cwd ``/``, umask 022), ``df`` naming the pool, ``kvfs umount`` waiting for the
right daemon, ``kvfs policy`` refusing paths outside kvfs, and a refused mount
never advising ``kvfs format`` for a detached member.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvfs.cli import _parser, daemon, mounthelper
from kvfs.cli.umount import alive
from kvfs.common.errors import UserError
from kvfs.testing import harness
from tests.conftest import META_SIZE, loop_unavailable, require_fuse, wait_for

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "tools" / "systemd" / "kvfs@.service"
SECURE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""The PATH mount(8) gives mount.fuse3, whatever the caller's."""


def kvfs(*args: object, cwd: str | Path | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kvfs", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=cwd)


def mount_parser() -> object:
    import argparse

    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["mount"]


def fresh_pool(tmp_path: Path, label: str = "") -> Path:
    img = harness.make_image(tmp_path / "pool.img", 256 << 20)
    r = kvfs("format", img, "--meta-size", META_SIZE, *(["--label", label] if label else []))
    assert r.returncode == 0, r.stderr
    return img


def entry(mnt: Path) -> daemon.Mount:
    m = daemon.mount_at(os.path.realpath(mnt))
    assert m is not None, f"{mnt} not mounted"
    return m


def umount_and_wait_gone(mnt: Path) -> None:
    pid = daemon.daemon_pid(entry(mnt))
    assert pid is not None, "no pidfile for the mount"
    r = kvfs("umount", mnt, cwd="/")
    assert r.returncode == 0, r.stderr
    assert not alive(pid), f"daemon {pid} still running after kvfs umount returned"
    assert not harness.is_mounted(mnt)


def safe_unmount(mnt: Path) -> None:
    if harness.is_mounted(mnt):
        kvfs("umount", mnt)
    if harness.is_mounted(mnt):
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)


# ---------------------------------------------------------------------- -o translation
def test_o_options_map_to_mount_options() -> None:
    p = mount_parser()
    argv = mounthelper.translate(
        [
            "/d/a:/d/b",
            "/mnt/kv",
            "-o",
            "rw,nosuid,nodev,noatime,cache=1G,io-timeout=5",
            "-o",
            "foreground,allow_other,degraded,log_file=/x.log,debug,defaults,_netdev",
            "-o",
            "noauto,nofail,user,x-systemd.requires=a.service,eviction=lru",
        ],
        p,  # type: ignore[arg-type]
    )
    assert argv[:5] == ["--debug", "mount", "/mnt/kv", "/d/a", "/d/b"], argv
    rest = " ".join(argv[5:])
    for want in (
        "--cache 1G",
        "--io-timeout 5",
        "--foreground",
        "--allow-other",
        "--degraded",
        "--log-file /x.log",
        "--eviction lru",
        "--fuse-option nosuid",
        "--fuse-option nodev",
    ):
        assert want in rest, (want, argv)
    args = _parser().parse_args(argv)
    assert args.cache == 1 << 30 and args.degraded and args.fuse_option == ["nosuid", "nodev"]
    # every option of kvfs mount maps, except the format-only ones
    names = mounthelper.option_names(p)  # type: ignore[arg-type]
    for name in ("reserve", "max_file_size", "no_discard", "drop_unreadable", "create"):
        assert name in names, names
    if any(a.dest == "metrics" for a in p._actions):  # type: ignore[attr-defined]
        assert "metrics" in names
        got = mounthelper.translate(["/d", "/m", "-o", "metrics=127.0.0.1:9480"], p)  # type: ignore[arg-type]
        assert got[-2:] == ["--metrics", "127.0.0.1:9480"], got
    url = "mooncake://10.0.0.1:50051?metadata=http://10.0.0.1:8080/metadata&segment=1G"
    got = mounthelper.translate(["/d", "/m", "-o", f"rw,cluster={url}"], p)  # type: ignore[arg-type]
    assert got[-2:] == ["--cluster", url], got  # '=', '?', '&' inside the value survive
    for bad, why in (
        ("format", "unknown mount option"),
        ("force", "unknown mount option"),
        ("bogus=1", "unknown mount option -o bogus=1"),
        ("ro", "no read-only mode"),
        ("cache", "needs a value"),
        ("foreground=1", "is a flag"),
    ):
        with pytest.raises(UserError, match=why):
            mounthelper.translate(["/d", "/m", "-o", bad], p)  # type: ignore[arg-type]


def test_helper_errors_are_one_line() -> None:
    r = kvfs("/dev/nope", "/mnt/nope", "-o", "frobnicate")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "unknown mount option -o frobnicate" in r.stderr


# ---------------------------------------------------------------------- mount -t, fstab
def require_installed() -> None:
    found = shutil.which("kvfs", path=SECURE_PATH)
    venv = ROOT / ".venv" / "bin" / "kvfs"
    if found is None or os.path.realpath(found) != os.path.realpath(venv):
        why = f"kvfs on mount's PATH is {found}, not {venv}: run make install"
        if os.environ.get("CI"):  # CI runs make install first: this must not hide a bug
            pytest.fail(why)
        pytest.skip(why)
    if os.geteuid() != 0 or shutil.which("mount.fuse3") is None:
        pytest.skip("needs root and mount.fuse3 (fuse3)")


def test_mount_t_fuse_kvfs(tmp_path: Path) -> None:
    require_fuse()
    require_installed()
    img = fresh_pool(tmp_path, label="ops")
    mnt = tmp_path / "mnt t"  # a space: mount.fuse3 quotes it
    mnt.mkdir()
    log = tmp_path / "kvfs.log"
    try:
        r = subprocess.run(
            [
                "mount",
                "-t",
                "fuse.kvfs",
                str(img),
                str(mnt),
                "-o",
                f"nosuid,nodev,noatime,cache=64M,io_timeout=20,log_file={log}",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        m = entry(mnt)
        assert m.fstype == "fuse.kvfs" and m.source == "kvfs:ops", m
        with open("/proc/self/mountinfo") as f:
            line = next(x for x in f if x.split()[2] == m.devno)
        assert "nosuid" in line and "nodev" in line, line
        (mnt / "a").write_bytes(b"x" * 4096)
        df = subprocess.run(["df", str(mnt)], capture_output=True, text=True, check=True)
        assert "kvfs:ops" in df.stdout, df.stdout
        assert "pool loaded" in log.read_text()
        umount_and_wait_gone(mnt)
    finally:
        safe_unmount(mnt)


def test_fstab_line(tmp_path: Path) -> None:
    require_fuse()
    require_installed()
    img = fresh_pool(tmp_path)  # no label: df names the first device
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    log = tmp_path / "kvfs.log"
    opts = f"noauto,nofail,_netdev,x-systemd.requires=local-fs.target,cache=64M,log_file={log}"
    backup = Path("/etc/fstab").read_bytes()
    try:
        with open("/etc/fstab", "a") as f:
            f.write(f"{img} {mnt} fuse.kvfs {opts} 0 0\n")
        r = subprocess.run(["mount", str(mnt)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        m = entry(mnt)
        assert m.fstype == "fuse.kvfs" and m.source == str(img), m
        (mnt / "b").write_bytes(b"y" * 8192)
        assert (mnt / "b").read_bytes() == b"y" * 8192
        umount_and_wait_gone(mnt)
    finally:
        Path("/etc/fstab").write_bytes(backup)
        safe_unmount(mnt)
    assert Path("/etc/fstab").read_bytes() == backup


# ---------------------------------------------------------------------- systemd
def test_systemd_unit_verifies(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    text = UNIT.read_text()
    assert "Type=notify" in text and "KillSignal=SIGTERM" in text
    exe = next(w for w in text.split() if w.startswith("ExecStart="))[len("ExecStart=") :]
    if not os.access(exe, os.X_OK):
        text = text.replace(exe, str(ROOT / ".venv" / "bin" / "kvfs"))
    unit = tmp_path / "kvfs@mnt-kv.service"  # an instance of the template
    unit.write_text(text)
    r = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_notify_ready_and_clean_stop_on_sigterm(tmp_path: Path) -> None:
    require_fuse()
    img = fresh_pool(tmp_path)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    sock_path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(sock_path))
        sock.settimeout(60)
        env = dict(os.environ, NOTIFY_SOCKET=str(sock_path))
        cmd = [sys.executable, "-m", "kvfs", "mount", "--foreground", str(mnt), str(img)]
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)
        try:
            msg = sock.recv(4096).decode()
            assert "READY=1" in msg.split("\n") and f"MAINPID={proc.pid}" in msg, msg
            assert harness.is_mounted(mnt)
            (mnt / "f").write_bytes(b"z" * 1000)
            proc.send_signal(signal.SIGTERM)
            assert sock.recv(4096).decode() == "STOPPING=1"
            assert proc.wait(60) == 0
            assert not harness.is_mounted(mnt)
        finally:
            if proc.poll() is None:
                harness.stop(proc, mnt)
            assert proc.stderr is not None
            proc.stderr.close()
    # the final checkpoint happened: the file is there after a remount
    with harness.mounted(mnt, [img]):
        assert (mnt / "f").read_bytes() == b"z" * 1000


# ---------------------------------------------------------------------- signals, logs
def test_sighup_reopens_the_log_and_keeps_the_mount(tmp_path: Path) -> None:
    require_fuse()
    img = fresh_pool(tmp_path)
    mnt, log = tmp_path / "mnt", tmp_path / "kvfs.log"
    with harness.mounted(mnt, [img], log_file=log) as proc:
        wait_for(lambda: "pool loaded" in log.read_text(), what="first log line")
        log.rename(tmp_path / "kvfs.log.1")
        proc.send_signal(signal.SIGHUP)
        wait_for(log.exists, what="a new log file")
        wait_for(lambda: "log file reopened" in log.read_text(), what="the reopen line")
        assert proc.poll() is None and harness.is_mounted(mnt)
        (mnt / "still").write_bytes(b"up")
        assert (mnt / "still").read_bytes() == b"up"
        assert "log file reopened" not in (tmp_path / "kvfs.log.1").read_text()


def test_daemon_detaches_and_umount_waits_for_it_via_a_relative_mount(tmp_path: Path) -> None:
    require_fuse()
    img = fresh_pool(tmp_path)
    (tmp_path / "rel").mkdir()
    r = kvfs("mount", "rel", "pool.img", "--log-file", "kvfs.log", cwd=tmp_path)
    mnt = tmp_path / "rel"
    try:
        assert r.returncode == 0, r.stderr
        pid = daemon.daemon_pid(entry(mnt))
        assert pid is not None and str(pid) in r.stdout, r.stdout
        assert os.readlink(f"/proc/{pid}/cwd") == "/"
        with open(f"/proc/{pid}/status") as f:
            umask = next(x for x in f if x.startswith("Umask:")).split()[1]
        assert umask == "0022"
        assert entry(mnt).source == str(img)
        wait_for(lambda: "pool loaded" in (tmp_path / "kvfs.log").read_text(), what="log")
        umount_and_wait_gone(mnt)  # from cwd /, by its absolute path
    finally:
        safe_unmount(mnt)


# ---------------------------------------------------------------------- safe commands
def test_policy_refuses_paths_outside_kvfs(tmp_path: Path) -> None:
    d = tmp_path / "plain"
    d.mkdir()
    r = kvfs("policy", d, "--set", "engine-managed")
    assert r.returncode == 2 and "not inside a kvfs mount" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1
    with contextlib.suppress(OSError):
        assert "user.kvfs.policy" not in os.listxattr(d)


def test_policy_inside_a_mount_still_works(tmp_path: Path) -> None:
    require_fuse()
    img = fresh_pool(tmp_path)
    mnt = tmp_path / "mnt"
    with harness.mounted(mnt, [img]):
        (mnt / "lmcache").mkdir()
        r = kvfs("policy", mnt / "lmcache", "--set", "engine-managed")
        assert r.returncode == 0 and "policy engine-managed" in r.stdout, r.stderr


def test_detached_member_is_never_advised_format(tmp_path: Path) -> None:
    require_fuse()
    reason = loop_unavailable()
    if reason:
        pytest.skip(reason)
    img0 = harness.make_image(tmp_path / "m0.img", 128 << 20)
    img1 = harness.make_image(tmp_path / "m1.img", 128 << 20)
    mnt = tmp_path / "mnt"
    loop = subprocess.run(
        ["losetup", "-f", "--show", str(img1)], check=True, capture_output=True, text=True
    ).stdout.strip()
    try:
        with harness.mounted(mnt, [img0, loop], "--format", "--meta-size", META_SIZE):
            (mnt / "f").write_bytes(b"q" * (3 << 20))
    finally:  # detached once, here: the node may be someone else's right after
        subprocess.run(["losetup", "-d", loop], check=True, capture_output=True)
    time.sleep(0.2)

    def still_detached() -> bool:
        with open(loop, "rb") as f:  # a detached loop device reads as 0 bytes
            return f.seek(0, os.SEEK_END) == 0

    detached = still_detached()
    for extra in ([], ["--degraded"]):
        if not detached:  # another process (a test suite beside this one) attached it
            break
        r = kvfs("mount", "--foreground", mnt, img0, loop, *extra)
        detached = still_detached()  # and not attached while kvfs looked at it
        if detached:
            assert r.returncode != 0 and r.stderr.count("\n") == 1, r.stderr
            assert "format" not in r.stderr and "--force" not in r.stderr, r.stderr
            assert "not a kvfs pool member" in r.stderr, r.stderr
        assert not harness.is_mounted(mnt)
    # left out, the member is named missing and --degraded is what is safe
    r = kvfs("mount", "--foreground", mnt, img0)
    assert "member 2 is missing" in r.stderr and "--degraded" in r.stderr, r.stderr
    assert "format" not in r.stderr
    if not detached:
        pytest.skip(f"{loop} was attached again by another process before the check")


# ---------------------------------------------------------------------- what a new user hits
def daemon_mount(
    tmp_path: Path, *extra: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``kvfs mount`` (daemonized) of a fresh pool at tmp_path/mnt."""
    img = fresh_pool(tmp_path)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(
        [sys.executable, "-m", "kvfs", "mount", str(mnt), str(img), *extra],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    return r


def test_a_stale_mount_says_to_umount_it(tmp_path: Path) -> None:
    require_fuse()
    mnt = tmp_path / "mnt"
    daemon_mount(tmp_path, "--log-file", str(tmp_path / "kvfs.log"))
    try:
        pid = daemon.daemon_pid(entry(mnt))
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not alive(pid), timeout=60, what="the killed daemon to exit")
        want = f"{mnt}: stale kvfs mount (its daemon is gone): run `kvfs umount {mnt}`"
        for argv in (("stats", mnt), ("stats", mnt / "sub"), ("mount", mnt, tmp_path / "pool.img")):
            r = kvfs(*argv)
            assert r.returncode == 2 and r.stderr == f"kvfs: {want}\n", (argv, r.stderr)
        r = kvfs("umount", mnt)
        assert r.returncode == 0 and r.stderr == "", r.stderr
        assert not harness.is_mounted(mnt)
    finally:
        safe_unmount(mnt)


HOLDER = """
import sys
f = open(sys.argv[1], "rb")
print("open", flush=True)
sys.stdin.readline()
sys.stdout.write(f.read().hex())
"""


def test_umount_of_a_busy_mount_names_its_users_and_lazy_detaches(tmp_path: Path) -> None:
    require_fuse()
    mnt = tmp_path / "mnt"
    daemon_mount(tmp_path, "--log-file", str(tmp_path / "kvfs.log"))
    data = os.urandom(3 << 20)
    holder = None
    try:
        harness.write_file(mnt / "chunk", data)
        pid = daemon.daemon_pid(entry(mnt))
        assert pid is not None
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(mnt / "chunk")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline() == "open\n"
        r = kvfs("umount", mnt)
        assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
        assert f"pid {holder.pid} (python" in r.stderr, r.stderr
        assert f"kvfs umount --lazy {mnt}" in r.stderr and "busy" in r.stderr, r.stderr
        assert harness.is_mounted(mnt) and (mnt / "chunk").read_bytes() == data
        r = kvfs("umount", "--lazy", mnt)
        assert r.returncode == 0, r.stderr
        assert f"pid {holder.pid}" in r.stdout and "detached" in r.stdout, r.stdout
        assert not harness.is_mounted(mnt) and alive(pid)
        out, _ = holder.communicate("\n", timeout=60)  # it still reads its open file
        assert holder.returncode == 0 and bytes.fromhex(out) == data
        wait_for(lambda: not alive(pid), timeout=60, what="the daemon to end")
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()
            holder.wait()
        safe_unmount(mnt)


def test_daemon_logs_go_to_syslog_never_to_the_terminal(tmp_path: Path) -> None:
    require_fuse()
    sock_path = tmp_path / "syslog.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as syslog:
        syslog.bind(str(sock_path))
        syslog.settimeout(60)
        env = dict(os.environ, KVFS_SYSLOG=str(sock_path))
        img = fresh_pool(tmp_path)
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        try:
            r = subprocess.run(
                [sys.executable, "-m", "kvfs", "mount", str(mnt), str(img)],
                capture_output=True,
                text=True,
                timeout=120,
                env=env,
            )
            assert r.returncode == 0, r.stderr
            assert r.stderr == "", "log lines on the terminal: " + r.stderr
            assert r.stdout.startswith(f"kvfs: mounted {mnt} (pid ") and r.stdout.count("\n") == 1
            seen = ""
            while "pool loaded" not in seen:
                seen += syslog.recv(65536).decode()
            assert "kvfs[" in seen, seen
            umount_and_wait_gone(mnt)
        finally:
            safe_unmount(mnt)


def test_without_syslog_a_daemon_logs_to_a_file_it_names(tmp_path: Path) -> None:
    require_fuse()
    no_syslog = tmp_path / "no-syslog"
    env = dict(os.environ, KVFS_SYSLOG=str(no_syslog), KVFS_LOG_DIR=str(tmp_path))
    mnt = tmp_path / "mnt"
    try:
        r = daemon_mount(tmp_path, env=env)
        log = tmp_path / f"kvfs-{str(mnt).strip('/').replace('/', '-')}.log"
        assert r.stderr == "" and r.stdout.count("\n") == 1, r
        assert r.stdout.startswith(f"kvfs: mounted {mnt} (pid "), r.stdout
        assert r.stdout.endswith(f"; no syslog ({no_syslog} missing): it logs to {log}\n")
        wait_for(lambda: log.exists() and "pool loaded" in log.read_text(), what="the log file")
        umount_and_wait_gone(mnt)
    finally:
        safe_unmount(mnt)
