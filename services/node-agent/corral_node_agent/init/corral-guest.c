/*
 * corral-guest: what stands between a microvm/vm guest's agent (full root of the guest kernel,
 * guest/agent.sh) and the commands it runs for the sandbox.
 *
 * Why it exists: the guest's kernel is the boundary to the host, but inside the guest the
 * sandbox's commands must still not reach the agent, the harness's (grader's) processes and
 * files, or the kernel's knobs: a command that could would make a reward mean nothing. So the
 * guest gives its commands what a container gives them: their own PID namespace and /proc (the
 * agent's processes are not there to see or trace), the image's root, no capability (bounding
 * set included, root gets none back at execve), no_new_privs and a seccomp filter that refuses
 * mounts, namespaces, module and kexec loading, BPF, keyrings and io_uring; harness commands run
 * as HARNESS_ID, which the agent (root without CAP_DAC_*, CAP_KILL, CAP_SYS_PTRACE) cannot read,
 * signal or trace.
 *
 *   corral-guest hold PIDFILE ROOT    started once by the guest's init: a process that is PID 1 of
 *                                     a new PID namespace and holds a mount namespace whose "/" is
 *                                     ROOT (the image's overlay) with the sandbox's /proc, /sys and
 *                                     /dev (sandbox_view); writes its pid (as the guest sees it) to
 *                                     PIDFILE and the parent exits. It reaps orphans.
 *   corral-guest enter [--harness|--files] PIDFILE -- CMD ARGS...
 *                                     enters the holder's namespaces and root, forks the command
 *                                     there with every privilege dropped (--files: all but those
 *                                     file access takes (FILE_CAPS), for the node's file
 *                                     operations), and exits with its status
 *                                     (128+signal if it was killed). 125 on a set-up failure, with
 *                                     the reason on stderr.
 *   corral-guest guard PIDFILE QDIR READY RATE BURST < LIST
 *                                     enforces the sandbox's protected paths and canaries (LIST:
 *                                     NUL-terminated "p/path" and "c/path") with fanotify
 *                                     permission events in the guest's kernel, as the node does for
 *                                     a container (audit/fanotify.py): an open of a protected
 *                                     file or directory by a sandbox process is denied (EPERM), a
 *                                     canary's allowed, and each is reported to the host as an
 *                                     "E" line handed to the agent's writer (QDIR/q) before the
 *                                     answer, so it is on the channel before anything the opener
 *                                     does next. Creates READY once every mark is set, then serves
 *                                     until killed. Opens by the agent itself (its cgroup is not
 *                                     under /sandbox) are not reported, but for files.read's (the
 *                                     cgroup /read), and are denied protected files all the same.
 *                                     With RATE > 0 it reports the sandbox's file activity too
 *                                     (opens, writes, execs: a notification group on its root's
 *                                     superblock), RATE events/s after a burst of BURST. A line
 *                                     (an id) in QDIR/gctl is answered "P id" once every event
 *                                     read before it is handed on: the host's consistent point.
 *   corral-guest opaque DIR           prints, NUL-terminated and relative to DIR, the directories
 *                                     under DIR marked opaque (xattr trusted.overlay.opaque = y):
 *                                     what a tar of an overlay's upper directory does not carry.
 *
 * Statically linked: the guest's initramfs has no libc.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/audit.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ftw.h>
#include <dirent.h>
#include <linux/openat2.h>
#include <sys/fanotify.h>
#include <poll.h>
#include <sys/mount.h>
#include <sys/xattr.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define HARNESS_ID 64222

static int die(const char *what) {
    dprintf(2, "corral-guest: %s: %s\n", what, strerror(errno));
    return 125;
}

/* the node's file operations keep what reading and writing any file of the sandbox takes
   (CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER, CAP_FSETID) and nothing else:
   without CAP_SYS_PTRACE a link through /proc/<pid>/ of the harness's processes is refused */
#define FILE_CAPS 0x1fULL

/* the bounding set cut to `keep`, and no ambient capability */
static int drop_bounding(unsigned long long keep) {
    for (int c = 0; c <= 63; c++)
        if (!(keep & (1ULL << c)) && prctl(PR_CAPBSET_DROP, c, 0, 0, 0) != 0 && errno != EINVAL) return -1;
    return prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
}

/* no capability in any set, none to be had back: root's execve grants nothing (SECBIT_NOROOT) */
static int drop_caps(void) {
    if (drop_bounding(0) != 0) return -1;
    /* SECBIT_NOROOT | SECBIT_NOROOT_LOCKED */
    if (prctl(PR_SET_SECUREBITS, 0x01 | 0x02, 0, 0, 0) != 0) return -1;
    return 0;
}

static int clear_caps(void) {
    struct __user_cap_header_struct h = {.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
    struct __user_cap_data_struct d[2];
    memset(d, 0, sizeof d);
    return (int)syscall(SYS_capset, &h, d);
}

#define NS_FLAGS (CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET | 0x80)
#define DENY(nr) BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (nr), 0, 1), BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM)

static int install_filter(void) {
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, 0x40000000, 0, 1), /* x32 */
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
        /* clone3's flags are behind a pointer a filter cannot read: ENOSYS sends libcs to clone */
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_clone3, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
        DENY(__NR_mount), DENY(__NR_umount2), DENY(__NR_pivot_root), DENY(__NR_chroot), DENY(__NR_unshare),
        DENY(__NR_setns), DENY(__NR_kexec_load), DENY(__NR_kexec_file_load), DENY(__NR_init_module),
        DENY(__NR_finit_module), DENY(__NR_delete_module), DENY(__NR_bpf), DENY(__NR_perf_event_open),
        DENY(__NR_userfaultfd), DENY(__NR_keyctl), DENY(__NR_add_key), DENY(__NR_request_key),
        DENY(__NR_open_by_handle_at), DENY(__NR_name_to_handle_at), DENY(__NR_reboot), DENY(__NR_swapon),
        DENY(__NR_swapoff), DENY(__NR_acct), DENY(__NR_quotactl), DENY(__NR_iopl), DENY(__NR_ioperm),
        DENY(__NR_syslog), DENY(__NR_io_uring_setup), DENY(__NR_io_uring_enter), DENY(__NR_io_uring_register),
        DENY(__NR_fsopen), DENY(__NR_fsmount), DENY(__NR_move_mount), DENY(__NR_open_tree), DENY(__NR_mount_setattr),
        /* clone with a namespace flag */
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_clone, 0, 3),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[0])),
        BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, NS_FLAGS, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {.len = sizeof f / sizeof f[0], .filter = f};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return -1;
    return (int)syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog);
}

/* what the sandbox sees of the guest, in the holder's mount namespace: a /proc of its PID
   namespace with the kernel's knobs read-only, a read-only /sys, and a /dev of harmless devices
   only (not the guest's devtmpfs: its virtio-serial port is the agent's line to the host) */
static int sandbox_view(const char *root) {
    char p[4096];
    snprintf(p, sizeof p, "%s/proc", root);
    umount2(p, MNT_DETACH);
    if (mount("proc", p, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) != 0) return -1;
    const char *ro[] = {"sys", "sysrq-trigger", "irq", "bus", "fs"};
    for (size_t i = 0; i < sizeof ro / sizeof ro[0]; i++) {
        snprintf(p, sizeof p, "%s/proc/%s", root, ro[i]);
        if (access(p, F_OK) != 0) continue;
        if (mount(p, p, NULL, MS_BIND | MS_REC, NULL) != 0 ||
            mount(NULL, p, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) != 0) return -1;
    }
    const char *masked[] = {"kcore", "keys", "timer_list", "kallsyms", "sched_debug"};
    for (size_t i = 0; i < sizeof masked / sizeof masked[0]; i++) {
        snprintf(p, sizeof p, "%s/proc/%s", root, masked[i]);
        if (access(p, F_OK) == 0 && mount("/dev/null", p, NULL, MS_BIND, NULL) != 0) return -1;
    }
    snprintf(p, sizeof p, "%s/sys", root);
    if (mount(p, p, NULL, MS_BIND | MS_REC, NULL) != 0 ||
        mount(NULL, p, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) != 0) return -1;
    snprintf(p, sizeof p, "%s/dev", root);
    umount2(p, MNT_DETACH);
    if (mount("tmpfs", p, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k") != 0) return -1;
    const char *devs[] = {"null", "zero", "full", "random", "urandom", "tty"};
    for (size_t i = 0; i < sizeof devs / sizeof devs[0]; i++) {
        char src[64];
        snprintf(src, sizeof src, "/dev/%s", devs[i]);
        snprintf(p, sizeof p, "%s/dev/%s", root, devs[i]);
        int fd = open(p, O_CREAT | O_WRONLY | O_CLOEXEC, 0666);
        if (fd < 0) return -1;
        close(fd);
        if (mount(src, p, NULL, MS_BIND, NULL) != 0) return -1;
    }
    const char *dirs[][4] = {{"pts", "devpts", "newinstance,ptmxmode=0666,mode=0620", ""}, {"shm", "tmpfs", "mode=1777,size=64m", ""}};
    for (size_t i = 0; i < 2; i++) {
        snprintf(p, sizeof p, "%s/dev/%s", root, dirs[i][0]);
        if (mkdir(p, 0755) != 0 || mount(dirs[i][1], p, dirs[i][1], MS_NOSUID | MS_NOEXEC, dirs[i][2]) != 0) return -1;
    }
    const char *links[][2] = {{"ptmx", "pts/ptmx"}, {"fd", "/proc/self/fd"}, {"stdin", "/proc/self/fd/0"},
                              {"stdout", "/proc/self/fd/1"}, {"stderr", "/proc/self/fd/2"}};
    for (size_t i = 0; i < sizeof links / sizeof links[0]; i++) {
        snprintf(p, sizeof p, "%s/dev/%s", root, links[i][0]);
        if (symlink(links[i][1], p) != 0) return -1;
    }
    return 0;
}

static void oom_adj(const char *value) {
    int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (fd < 0) return;
    if (write(fd, value, strlen(value)) < 0) { /* best effort: the OOM killer's choice, not the sandbox's walls */ }
    close(fd);
}

static int hold(const char *pidfile, const char *root) {
    if (unshare(CLONE_NEWPID | CLONE_NEWNS) != 0) return die("unshare");
    pid_t pid = fork();
    if (pid < 0) return die("fork");
    if (pid > 0) {
        FILE *f = fopen(pidfile, "w");
        if (!f || fprintf(f, "%d\n", pid) < 0 || fclose(f) != 0) return die(pidfile);
        return 0;
    }
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0) _exit(die("private mounts"));
    if (sandbox_view(root) != 0) _exit(die("the sandbox's /proc, /sys and /dev"));
    /* the image's root becomes this namespace's "/" (switch_root's move: the initramfs cannot be
       pivoted away), so nothing of the guest's own files is left to reach through /proc/1/root */
    if (chdir(root) != 0 || mount(root, "/", NULL, MS_MOVE, NULL) != 0 || chroot(".") != 0 || chdir("/") != 0)
        _exit(die("the sandbox's root"));
    oom_adj("-1000"); /* PID 1 of the namespace: its end would take every process of the sandbox */
    if (drop_caps() != 0 || clear_caps() != 0) _exit(die("dropping capabilities"));
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    syscall(SYS_close_range, 3, ~0U, 0);
    int fd = open("/dev/null", O_RDWR);
    if (fd >= 0) {
        dup2(fd, 0), dup2(fd, 1), dup2(fd, 2);
        if (fd > 2) close(fd);
    }
    /* PID 1 of the namespace: orphans come here to be reaped */
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigprocmask(SIG_BLOCK, &chld, NULL);
    for (;;) {
        while (waitpid(-1, NULL, WNOHANG) > 0) {
        }
        sigwaitinfo(&chld, NULL);
    }
}

/* the pid `hold` wrote (0 if none) */
static int holder_pid(const char *pidfile) {
    FILE *f = fopen(pidfile, "r");
    int holder = 0;
    if (f && fscanf(f, "%d", &holder) != 1) holder = 0;
    if (f) fclose(f);
    return holder;
}

/* mode: 0 the agent's command, 1 the harness's, 2 the node's file operations (root, all its
   capabilities, but the sandbox's view of the files: its symlinks lead nowhere else) */
static int enter(int mode, const char *pidfile, char **argv) {
    int holder = holder_pid(pidfile);
    if (holder <= 1) return die("the sandbox's namespace holder");
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/root", holder);
    int rootfd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (rootfd < 0) return die(path);
    const char *kinds[] = {"pid", "mnt"};
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof path, "/proc/%d/ns/%s", holder, kinds[i]);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0 || setns(fd, 0) != 0) return die(path);
        close(fd);
    }
    if (fchdir(rootfd) != 0 || chroot(".") != 0 || chdir("/") != 0) return die("the sandbox's root");
    close(rootfd);
    pid_t pid = fork();
    if (pid < 0) return die("fork");
    if (pid == 0) {
        signal(SIGPIPE, SIG_DFL);
        oom_adj("0"); /* the agent is spared by the OOM killer (-1000): not what it runs */
        /* nothing of the agent's but stdio: its shell holds the virtio-serial port (its line to
           the host) and more, and a descriptor left open would be the command's to write to */
        if (syscall(SYS_close_range, 3, ~0U, 0) != 0) _exit(die("closing the agent's descriptors"));
        if (mode == 2) { /* root's execve leaves it the bounding set: FILE_CAPS */
            if (drop_bounding(FILE_CAPS) != 0 || prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
                _exit(die("dropping capabilities"));
        } else {
            if (drop_caps() != 0) _exit(die("dropping the bounding set"));
            if (mode == 1 && (setgroups(0, NULL) != 0 || setresgid(HARNESS_ID, HARNESS_ID, HARNESS_ID) != 0 ||
                              setresuid(HARNESS_ID, HARNESS_ID, HARNESS_ID) != 0))
                _exit(die("becoming the harness user"));
            if (clear_caps() != 0) _exit(die("dropping capabilities"));
            if (install_filter() != 0) _exit(die("installing the seccomp filter"));
        }
        execvp(argv[0], argv);
        int e = errno;
        dprintf(2, "corral: cannot run %s: %s\n", argv[0], strerror(e));
        _exit(e == ENOENT ? 127 : 126);
    }
    /* the command's stdio are its own now; this process only waits for it (a signal that ends
       the exec's process group ends it too, and the kill of its cgroup the command) */
    int status;
    while (waitpid(pid, &status, 0) < 0)
        if (errno != EINTR) return die("wait");
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* ---------------------------------------------------------------- guard */

#define GUARD_FILE_MASK (FAN_OPEN_PERM | FAN_OPEN_EXEC_PERM)
#define GUARD_DIR_MASK (FAN_OPEN_PERM | FAN_OPEN_EXEC_PERM | FAN_EVENT_ON_CHILD | FAN_ONDIR)
#define GUARD_MAX_TREE 10000 /* directories marked under one protected directory (as on the node) */

struct guarded {
    dev_t dev;
    ino_t ino;
    char kind; /* 'p' protected, 'c' canary */
    char dir;
    char *path;
};
static struct guarded *guarded;
static size_t n_guarded, cap_guarded;
static char **tops; /* the protected paths: a file made under one after marking is protected too */
static size_t n_tops;
static int guard_root = -1, guard_fan = -1, guard_q = -1;
static const char *guard_qdir;
static unsigned long guard_seq;

static void guarded_add(const struct stat *st, char kind, const char *path) {
    if (n_guarded == cap_guarded) {
        cap_guarded = cap_guarded ? 2 * cap_guarded : 256;
        guarded = realloc(guarded, cap_guarded * sizeof *guarded);
        if (!guarded) _exit(die("memory"));
    }
    guarded[n_guarded++] = (struct guarded){st->st_dev, st->st_ino, kind, S_ISDIR(st->st_mode), strdup(path)};
}

static const struct guarded *guarded_find(dev_t dev, ino_t ino) {
    const struct guarded *hit = NULL;
    for (size_t i = 0; i < n_guarded; i++) /* a canary that is also protected counts as protected */
        if (guarded[i].dev == dev && guarded[i].ino == ino && (!hit || guarded[i].kind == 'p')) hit = &guarded[i];
    return hit;
}

/* `path` inside the sandbox's root, resolved there (a symlink cannot lead a mark out of it) */
static const char *guard_step = ""; /* what failed, for the error */

static int open_in_root(const char *path, int flags) {
    guard_step = "resolving it in the sandbox's root";
    struct open_how how = {.flags = (unsigned long long)(flags | O_CLOEXEC),
                           .resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV};
    return (int)syscall(SYS_openat2, guard_root, path, &how, sizeof how);
}

static int mark(const char *path, unsigned long long mask) {
    int fd = open_in_root(path, O_PATH);
    if (fd < 0) return -1;
    guard_step = "marking it";
    /* through the descriptor's link: the guest's kernel (6.1) takes no O_PATH descriptor for dirfd */
    char via[64];
    snprintf(via, sizeof via, "/proc/self/fd/%d", fd);
    int r = fanotify_mark(guard_fan, FAN_MARK_ADD, mask, AT_FDCWD, via);
    close(fd);
    return r;
}

/* the object at `path` and, for a directory, every directory below it: all listed before
   anything is marked (our own opens of a marked directory would wait for our own answer) */
static int guard_path(char kind, const char *path) {
    int fd = open_in_root(path, O_PATH);
    if (fd < 0) return errno == ENOENT ? 0 : -1; /* not in the image: nothing to mark */
    struct stat st;
    if (fstat(fd, &st) != 0) return close(fd), -1;
    close(fd);
    guarded_add(&st, kind, path);
    if (!S_ISDIR(st.st_mode)) return mark(path, GUARD_FILE_MASK);
    size_t first = n_guarded - 1, dirs = 1;
    for (size_t i = first; i < n_guarded; i++) {
        if (!guarded[i].dir) continue;
        const char *dpath = guarded[i].path;
        int dfd = open_in_root(dpath, O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
        if (dfd < 0) continue; /* gone meanwhile */
        DIR *d = fdopendir(dfd);
        if (!d) { close(dfd); continue; }
        struct dirent *e;
        while ((e = readdir(d)) != NULL) {
            if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
            struct stat cst;
            if (fstatat(dirfd(d), e->d_name, &cst, AT_SYMLINK_NOFOLLOW) != 0) continue;
            if (S_ISDIR(cst.st_mode) && dirs++ >= GUARD_MAX_TREE) continue;
            char child[4096];
            if (snprintf(child, sizeof child, "%s/%s", strcmp(dpath, "/") ? dpath : "", e->d_name) >= (int)sizeof child) continue;
            guarded_add(&cst, kind, child);
        }
        closedir(d);
    }
    for (size_t i = first; i < n_guarded; i++)
        if (guarded[i].dir && mark(guarded[i].path, GUARD_DIR_MASK) != 0 && errno != ENOENT) return -1;
    return 0;
}

static void b64(const unsigned char *in, size_t n, char *out) {
    static const char a[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    size_t o = 0;
    for (size_t i = 0; i < n; i += 3) {
        unsigned v = in[i] << 16 | (i + 1 < n ? in[i + 1] << 8 : 0) | (i + 2 < n ? in[i + 2] : 0);
        out[o++] = a[v >> 18 & 63], out[o++] = a[v >> 12 & 63];
        out[o++] = i + 1 < n ? a[v >> 6 & 63] : '=';
        out[o++] = i + 2 < n ? a[v & 63] : '=';
    }
    out[o] = 0;
}

/* what goes to the host, through the agent's writer like its answers: one file per flush */
static char out[256 * 1024];
static size_t out_len;
static double out_since; /* when its first line came */

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static void flush_out(void) {
    if (!out_len) return;
    char name[4200];
    snprintf(name, sizeof name, "%s/g%lu.out", guard_qdir, guard_seq++);
    int fd = open(name, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd >= 0) {
        int ok = write(fd, out, out_len) == (ssize_t)out_len;
        close(fd);
        if (ok) dprintf(guard_q, "%s\n", name);
    }
    out_len = 0;
}

/* one "E 0 kind pid denied who -comm -path" line */
static void report(const char *kind, int pid, int denied, const char *who, const char *path) {
    char comm[64] = "", p[64], c64[96], p64[5500];
    snprintf(p, sizeof p, "/proc/%d/comm", pid);
    int fd = pid > 0 ? open(p, O_RDONLY | O_CLOEXEC) : -1;
    if (fd >= 0) {
        ssize_t n = read(fd, comm, sizeof comm - 1);
        close(fd);
        comm[n > 0 ? n : 0] = 0;
        comm[strcspn(comm, "\n")] = 0;
    }
    b64((const unsigned char *)comm, strlen(comm), c64);
    b64((const unsigned char *)path, strnlen(path, 4000), p64);
    if (out_len + 6000 > sizeof out) flush_out();
    if (!out_len) out_since = now_s();
    out_len += (size_t)snprintf(out + out_len, sizeof out - out_len, "E 0 %s %d %d %s -%s -%s\n", kind, pid, denied,
                                who[0] ? who : "-", c64, p64);
}

/* whose open: "x<id>"/"s<name>" (an exec's or a session's cgroup under /sandbox), "read"
   (files.read), "" (the agent's own), "?" (gone already: taken for the sandbox's) */
static void opener(int pid, char *who, size_t size) {
    char p[64], buf[512];
    snprintf(p, sizeof p, "/proc/%d/cgroup", pid);
    int fd = open(p, O_RDONLY | O_CLOEXEC);
    ssize_t n = fd >= 0 ? read(fd, buf, sizeof buf - 1) : -1;
    if (fd >= 0) close(fd);
    if (n <= 0) { snprintf(who, size, "?"); return; }
    buf[n] = 0;
    buf[strcspn(buf, "\n")] = 0;
    const char *cg = strncmp(buf, "0::", 3) == 0 ? buf + 3 : "";
    if (strncmp(cg, "/sandbox/", 9) == 0 && cg[9]) snprintf(who, size, "%.*s", (int)strcspn(cg + 9, "/ "), cg + 9);
    else if (strcmp(cg, "/sandbox") == 0) snprintf(who, size, "?");
    else if (strcmp(cg, "/read") == 0) snprintf(who, size, "read");
    else who[0] = 0;
}

static int under(const char *path, const char *top) {
    size_t n = strlen(top);
    if (strcmp(top, "/") == 0) return 1;
    return strncmp(path, top, n) == 0 && (path[n] == 0 || path[n] == '/');
}

static void answer(const struct fanotify_event_metadata *m) {
    struct stat st = {0};
    const struct guarded *g = fstat(m->fd, &st) == 0 ? guarded_find(st.st_dev, st.st_ino) : NULL;
    char kind = g ? g->kind : 0, path[4096] = "", who[128];
    if (g) snprintf(path, sizeof path, "%s", g->path);
    if (!g) { /* made under a protected directory after the marks: by its path in the sandbox */
        char p[64];
        snprintf(p, sizeof p, "/proc/self/fd/%d", m->fd);
        ssize_t n = readlink(p, path, sizeof path - 1);
        path[n > 0 ? n : 0] = 0;
        for (size_t i = 0; n > 0 && i < n_tops; i++)
            if (under(path, tops[i])) kind = 'p';
    }
    int allow = 1;
    if (kind) {
        opener(m->pid, who, sizeof who);
        int dir = S_ISDIR(st.st_mode);
        allow = kind == 'c' || (who[0] == 0 && dir); /* the agent lists a protected tree (a guard after a resume) */
        if (who[0] && (kind == 'p' || !dir)) {
            report(kind == 'p' ? "p" : "c", m->pid, !allow, who, path);
            flush_out(); /* on the channel before the open returns */
        }
    }
    struct fanotify_response r = {.fd = m->fd, .response = allow ? FAN_ALLOW : FAN_DENY};
    if (write(guard_fan, &r, sizeof r) != sizeof r) { /* the opener is gone: nothing waits */ }
}

/* ---------------------------------------------------------------- file activity */

/* the sandbox's opens, writes and execs on its root filesystem (notification events: they never
   block it), as the node reports a container's in fd mode (audit/files.py): repeats of one (op,
   file) within ACT_WINDOW_S are coalesced, a token bucket (rate, burst) drops the rest, and the
   drops are reported once a second */
#define ACT_WINDOW_S 5.0 /* as the node's (audit/files.py) */
#define ACT_SEEN 4096
static int act_fan = -1;
static double act_rate, act_burst, act_tokens, act_refill, act_drop_told;
static unsigned long act_dropped;
static struct { unsigned long h; double at; } act_seen[ACT_SEEN];

static unsigned long fnv(const char *a, const char *b) {
    unsigned long h = 1469598103934665603UL;
    for (const char *p = a; *p; p++) h = (h ^ (unsigned char)*p) * 1099511628211UL;
    h = (h ^ 0xff) * 1099511628211UL;
    for (const char *p = b; *p; p++) h = (h ^ (unsigned char)*p) * 1099511628211UL;
    return h;
}

static void activity(const struct fanotify_event_metadata *m) {
    char who[128], p[64], path[4096];
    opener(m->pid, who, sizeof who);
    if (!who[0] || strcmp(who, "read") == 0) return; /* the agent's own: the node audits those requests itself */
    snprintf(p, sizeof p, "/proc/self/fd/%d", m->fd);
    ssize_t n = readlink(p, path, sizeof path - 1);
    if (n <= 0) return;
    path[n] = 0;
    const struct { unsigned long long bit; const char *op; } ops[] = {{FAN_OPEN_EXEC, "exec"}, {FAN_CLOSE_WRITE, "write"}, {FAN_OPEN, "open"}};
    for (size_t i = 0; i < 3; i++) {
        if (!(m->mask & ops[i].bit)) continue;
        double t = now_s();
        unsigned long h = fnv(ops[i].op, path);
        if (act_seen[h % ACT_SEEN].h == h && t - act_seen[h % ACT_SEEN].at < ACT_WINDOW_S) continue;
        act_seen[h % ACT_SEEN].h = h, act_seen[h % ACT_SEEN].at = t;
        act_tokens += (t - act_refill) * act_rate;
        if (act_tokens > act_burst) act_tokens = act_burst;
        act_refill = t;
        if (act_tokens < 1) { act_dropped++; continue; }
        act_tokens -= 1;
        report(ops[i].op, m->pid, 0, who, path);
    }
}

static void report_drops(void) {
    if (!act_dropped) return;
    char count[32];
    snprintf(count, sizeof count, "%lu", act_dropped);
    report("dropped", 0, 0, "-", count);
    act_dropped = 0, act_drop_told = now_s();
}

static void drain_activity(void) {
    static char buf[64 * 1024] __attribute__((aligned(8)));
    for (;;) {
        ssize_t len = read(act_fan, buf, sizeof buf);
        if (len <= 0) return; /* EAGAIN: nothing more queued */
        for (struct fanotify_event_metadata *m = (void *)buf; FAN_EVENT_OK(m, len); m = FAN_EVENT_NEXT(m, len)) {
            if (m->fd < 0) { /* the kernel's queue overflowed: how many were lost is unknown */
                if (m->mask & FAN_Q_OVERFLOW) report("overflow", 0, 0, "-", "");
                continue;
            }
            activity(m);
            close(m->fd);
        }
    }
}

static void drain_permissions(void) {
    static char buf[64 * 1024] __attribute__((aligned(8)));
    ssize_t len = read(guard_fan, buf, sizeof buf);
    for (struct fanotify_event_metadata *m = (void *)buf; len > 0 && FAN_EVENT_OK(m, len); m = FAN_EVENT_NEXT(m, len)) {
        if (m->fd < 0) continue; /* a queue overflow: permission events are never dropped */
        if (m->mask & (FAN_OPEN_PERM | FAN_OPEN_EXEC_PERM)) answer(m);
        close(m->fd);
    }
}

static int guard(const char *pidfile, const char *qdir, const char *ready, double rate, double burst) {
    int holder = holder_pid(pidfile);
    if (holder <= 1) return die("the sandbox's namespace holder");
    char p[4200];
    snprintf(p, sizeof p, "/proc/%d/root", holder);
    if ((guard_root = open(p, O_PATH | O_DIRECTORY | O_CLOEXEC)) < 0) return die(p);
    guard_qdir = qdir;
    snprintf(p, sizeof p, "%s/q", qdir);
    if ((guard_q = open(p, O_WRONLY | O_CLOEXEC)) < 0) return die(p);
    oom_adj("-1000"); /* the sandbox filling the guest's memory must not end it */
    if ((guard_fan = fanotify_init(FAN_CLASS_CONTENT | FAN_CLOEXEC, O_RDONLY | O_LARGEFILE | O_CLOEXEC)) < 0) return die("fanotify_init");
    static char list[1 << 20];
    size_t n = fread(list, 1, sizeof list - 1, stdin);
    list[n] = 0;
    for (size_t i = 0; i < n; i += strlen(list + i) + 1) {
        char kind = list[i], *path = list + i + 1;
        if ((kind != 'p' && kind != 'c') || path[0] != '/') { errno = EINVAL; return die("a guard entry"); }
        if (kind == 'p') {
            tops = realloc(tops, (n_tops + 1) * sizeof *tops);
            tops[n_tops++] = path;
        }
        if (guard_path(kind, path) != 0) {
            dprintf(2, "corral-guest: guarding %s (%s): %s\n", path, guard_step, strerror(errno));
            return 125;
        }
    }
    if (rate > 0) {
        if ((act_fan = fanotify_init(FAN_CLASS_NOTIF | FAN_CLOEXEC | FAN_NONBLOCK, O_RDONLY | O_LARGEFILE | O_CLOEXEC)) < 0)
            return die("fanotify_init (file activity)");
        snprintf(p, sizeof p, "/proc/%d/root", holder); /* the superblock of the sandbox's root */
        if (fanotify_mark(act_fan, FAN_MARK_ADD | FAN_MARK_FILESYSTEM, FAN_OPEN | FAN_OPEN_EXEC | FAN_CLOSE_WRITE, AT_FDCWD, p) != 0)
            return die("marking the sandbox's root filesystem");
        act_rate = rate, act_burst = act_tokens = burst, act_refill = act_drop_told = now_s();
    }
    /* the agent's "is all of it out" (its Q): every event read so far reported, then the answer */
    snprintf(p, sizeof p, "%s/gctl", qdir);
    int ctl = open(p, O_RDWR | O_NONBLOCK | O_CLOEXEC);
    if (ctl < 0) return die(p);
    int fd = open(ready, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) return die(ready);
    close(fd);
    for (;;) {
        struct pollfd pf[3] = {{guard_fan, POLLIN, 0}, {ctl, POLLIN, 0}, {act_fan, POLLIN, 0}};
        int wait = out_len ? 100 : act_dropped ? 1000 : -1;
        if (poll(pf, act_fan >= 0 ? 3 : 2, wait) < 0 && errno != EINTR) return die("poll");
        if (pf[0].revents & POLLIN) drain_permissions();
        if (act_fan >= 0 && (pf[2].revents & POLLIN)) drain_activity();
        if (act_dropped && now_s() - act_drop_told >= 1.0) report_drops();
        if (pf[1].revents & POLLIN) {
            char ids[512];
            ssize_t n = read(ctl, ids, sizeof ids - 1);
            if (act_fan >= 0) drain_activity();
            report_drops(); /* asked: the drops so far are part of the record too */
            ids[n > 0 ? n : 0] = 0;
            for (char *id = strtok(ids, "\n"); id; id = strtok(NULL, "\n")) {
                if (out_len + 64 > sizeof out) flush_out();
                if (!out_len) out_since = now_s();
                out_len += (size_t)snprintf(out + out_len, sizeof out - out_len, "P %.40s\n", id);
            }
            flush_out();
        }
        if (out_len && now_s() - out_since >= 0.1) flush_out();
    }
}

static size_t opaque_base;

static int opaque_one(const char *path, const struct stat *st, int type, struct FTW *ftw) {
    (void)st, (void)ftw;
    char v[2];
    if (type == FTW_D && lgetxattr(path, "trusted.overlay.opaque", v, sizeof v) == 1 && v[0] == 'y' && strlen(path) > opaque_base)
        printf("%s%c", path + opaque_base + 1, '\0');
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "opaque") == 0) {
        opaque_base = strlen(argv[2]);
        return nftw(argv[2], opaque_one, 64, FTW_PHYS) == 0 && fflush(stdout) == 0 ? 0 : die(argv[2]);
    }
    if (argc == 4 && strcmp(argv[1], "hold") == 0) return hold(argv[2], argv[3]);
    if (argc == 7 && strcmp(argv[1], "guard") == 0) return guard(argv[2], argv[3], argv[4], atof(argv[5]), atof(argv[6]));
    if (argc >= 5 && strcmp(argv[1], "enter") == 0) {
        int mode = strcmp(argv[2], "--harness") == 0 ? 1 : strcmp(argv[2], "--files") == 0 ? 2 : 0;
        int at = 2 + (mode != 0);
        if (argc >= at + 3 && strcmp(argv[at + 1], "--") == 0) return enter(mode, argv[at], argv + at + 2);
    }
    dprintf(2, "corral-guest: usage: corral-guest hold PIDFILE ROOT | corral-guest guard PIDFILE QDIR READY RATE BURST | corral-guest enter [--harness|--files] PIDFILE -- CMD...\n");
    return 125;
}
