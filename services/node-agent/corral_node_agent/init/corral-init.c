/*
 * corral-init: the resident helper that runs as PID 1 inside every container sandbox.
 *
 * Why it exists: entering a sandbox with `runc exec` costs ~25 ms per call, and entering its
 * namespaces from the host (nsenter) would not inherit the sandbox's seccomp filter, capability
 * drop and no_new_privs. A process forked by the sandbox's own init inherits all of them for free,
 * so exec becomes one unix-socket round trip plus fork/exec.
 *
 * fds: 3 is the listening socket (its path lives on the host, outside the sandbox's mount
 * namespace); 4 and 5 are detached clones of the sandbox's tmpfs and root filesystem, which init
 * only holds so the node-agent can reach them as /proc/<init>/fd/4|5 (the host keeps no mount per
 * sandbox). All three come from `runc run --preserve-fds 3`. Fd 6 is the sandbox's seccomp notify
 * fd, which the node-agent hands over with a "hold" request: runc sends it to the agent once, at
 * start, so an agent that restarts takes it back from here (pidfd_getfd) and keeps answering (and
 * auditing) the notified calls of the sandboxes it adopts. None of them reaches an exec'd child.
 *
 * Privileges: init keeps CAP_SETUID, CAP_SETGID and CAP_SETPCAP (and nothing else) so that it can
 * start harness commands as HARNESS_ID; every child drops all of them (bounding set included)
 * before it execs, and dies rather than run with any left. Agent commands run as root without a
 * capability; harness commands run as HARNESS_ID, so the agent's processes (another uid, no
 * CAP_SYS_PTRACE, CAP_KILL or CAP_DAC_*) can neither read a harness process's /proc/<pid>/fd,
 * mem or environ, nor signal it, nor read its scripts in the io dir.
 *
 * Protocol (the node-agent is the only peer):
 *   request:  u32 little-endian payload length, then the payload, with SCM_RIGHTS fds on the first
 *             byte: [stdin, stdout, stderr, cgroup.procs fds...]. Payload is NUL-terminated tokens:
 *             kind, argc, argv..., envc, env..., cwd, ncgroup; kind "1" runs an agent command,
 *             "3" a harness command (as HARNESS_ID).
 *             A payload of just "1", "0" (argc 0, no fds) is a ping: the reply is u32 1, so the
 *             node-agent knows init has exec'd and serves requests. A payload of just "2" with
 *             one fd is a hold (see fd 6 above): the reply is u32 1 once it is kept.
 *   replies:  u32 pid (as seen inside the sandbox) once the child is forked, or 0 on failure;
 *             then i32 wait status when the child exits; then the connection is closed.
 * Under gVisor (the `gvisor` substrate: runsc passes no fds) init is started as
 *   corral-init --listen PATH TOKENFILE
 * and makes the listening socket itself at PATH, a path in a host directory bind-mounted into the
 * sandbox (runsc --host-uds=create), so the socket is a host socket the node-agent connects to.
 * The sandbox's own processes see that path, but gVisor lets them connect to no host socket
 * (--host-uds=create allows only making one), and the node-agent moves it out of the directory
 * (a hard link elsewhere, then unlink) before anything else runs. As a second lock, every
 * request's payload starts with a secret token, read from TOKENFILE (written by the node-agent)
 * and unlinked at start. There are no exec cgroups there (ncgroup is 0); instead a payload "4", pid
 * kills the process group (= session: every child calls setsid) of a child init started, which
 * is how a timeout ends an exec's tree. Reply u32 1 if it was init's child.
 * The child moves itself into the per-exec cgroups by writing "0" to the cgroup.procs fds the
 * node-agent opened on the host, so the node-agent can later freeze and kill exactly the processes
 * this exec started, however they daemonise.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <grp.h>
#include <linux/capability.h>
#include <unistd.h>

#define LISTEN_FD 3
#define HELD_FD_LAST 5 /* the tmpfs and root clones (4, 5) */
#define NOTIFY_FD 6
#define MAX_FDS 16
#define MAX_PAYLOAD (4 * 1024 * 1024)
#define HARNESS_ID 64222 /* uid and gid of harness commands (services/node-agent .../oci.py HARNESS_ID) */

#define TOKEN_MAX 64
static char token[TOKEN_MAX + 1]; /* empty: no token asked (runc: the socket is outside the sandbox) */

struct child { pid_t pid; int conn; };
static struct child *children;
static size_t nchildren, capchildren;

static void track(pid_t pid, int conn) {
    if (nchildren == capchildren) {
        capchildren = capchildren ? capchildren * 2 : 64;
        children = realloc(children, capchildren * sizeof(*children));
        if (!children) _exit(111);
    }
    children[nchildren].pid = pid;
    children[nchildren].conn = conn;
    nchildren++;
}

static void finish(pid_t pid, int status) {
    for (size_t i = 0; i < nchildren; i++) {
        if (children[i].pid == pid) {
            int32_t st = status;
            ssize_t w = send(children[i].conn, &st, sizeof st, MSG_NOSIGNAL);
            (void)w;
            close(children[i].conn);
            children[i] = children[--nchildren];
            return;
        }
    }
    /* an orphan reparented to us: reaped, nothing to report */
}

static int read_full(int fd, void *buf, size_t len) {
    char *p = buf;
    while (len) {
        ssize_t r = read(fd, p, len);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        p += r; len -= (size_t)r;
    }
    return 0;
}

static void reply_u32(int conn, uint32_t v) {
    ssize_t w = send(conn, &v, sizeof v, MSG_NOSIGNAL);
    (void)w;
}

/* In a child, before exec: become HARNESS_ID (harness) or stay root (agent), with no capability in
 * any set. Returns 0 only when nothing is left. */
static int drop_privileges(int harness) {
    if (harness && (setgroups(0, NULL) != 0 || setresgid(HARNESS_ID, HARNESS_ID, HARNESS_ID) != 0)) return -1;
    for (int c = 0; c <= 63; c++) {
        int has = prctl(PR_CAPBSET_READ, c, 0, 0, 0);
        if (has < 0) break; /* past CAP_LAST_CAP */
        if (has == 1 && prctl(PR_CAPBSET_DROP, c, 0, 0, 0) != 0) return -1;
    }
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0 && errno != EINVAL) return -1;
    if (harness && setresuid(HARNESS_ID, HARNESS_ID, HARNESS_ID) != 0) return -1;
    struct __user_cap_header_struct h = {.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
    struct __user_cap_data_struct d[2];
    memset(d, 0, sizeof d);
    if (syscall(SYS_capset, &h, d) != 0) return -1;
    if (syscall(SYS_capget, &h, d) != 0) return -1;
    for (int i = 0; i < 2; i++)
        if (d[i].effective || d[i].permitted || d[i].inheritable) return -1;
    if (prctl(PR_CAPBSET_READ, CAP_SETUID, 0, 0, 0) != 0) return -1;
    if (harness && (getuid() != HARNESS_ID || geteuid() != HARNESS_ID || getgid() != HARNESS_ID)) return -1;
    return 0;
}

static void spawn(int conn) {
    char cbuf[CMSG_SPACE(sizeof(int) * MAX_FDS)];
    uint32_t len = 0;
    struct iovec iov = {.iov_base = &len, .iov_len = sizeof len};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
    int fds[MAX_FDS];
    int nfds = 0;
    ssize_t r = recvmsg(conn, &msg, MSG_CMSG_CLOEXEC | MSG_WAITALL);
    if (r != (ssize_t)sizeof len) { close(conn); return; }
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            int n = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int i = 0; i < n && nfds < MAX_FDS; i++) memcpy(&fds[nfds++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        }
    }
    char *payload = NULL;
    char **argv = NULL, **envp = NULL;
    if (len == 0 || len > MAX_PAYLOAD) goto fail;
    payload = malloc(len + 1);
    if (!payload || read_full(conn, payload, len) < 0) goto fail;
    payload[len] = 0;
    char *body = payload;
    if (token[0]) {
        size_t tl = strlen(token);
        if (len < tl + 1 || memcmp(payload, token, tl + 1) != 0) goto fail;
        body += tl + 1;
        len -= (uint32_t)(tl + 1);
    }
    if (nfds == 0 && len >= 2 && memcmp(body, "4\0", 2) == 0) {
        /* kill the process group of one of our children (gVisor: no exec cgroups) */
        long victim = strtol(body + 2, NULL, 10);
        int ours = 0;
        for (size_t i = 0; i < nchildren; i++) ours |= victim > 1 && children[i].pid == victim;
        if (ours) { kill(-(pid_t)victim, SIGKILL); kill((pid_t)victim, SIGKILL); }
        free(payload);
        reply_u32(conn, ours ? 1 : 0);
        close(conn);
        return;
    }
    if (nfds == 0 && len == 4 && memcmp(body, "1\0" "0\0", 4) == 0) {
        free(payload);
        reply_u32(conn, 1);
        close(conn);
        return;
    }
    if (nfds == 1 && len == 2 && memcmp(body, "2\0", 2) == 0) {
        /* hold: keep this fd (the sandbox's seccomp notify fd) as NOTIFY_FD, replacing any */
        int ok = dup3(fds[0], NOTIFY_FD, O_CLOEXEC) == NOTIFY_FD;
        close(fds[0]);
        free(payload);
        reply_u32(conn, ok ? 1 : 0);
        close(conn);
        return;
    }
    if (nfds < 3) goto fail;
    /* tokenise */
    char *p = body, *end = body + len;
#define NEXT() ({ char *_t = p; if (p >= end) goto fail; p += strlen(p) + 1; _t; })
    char *kind = NEXT();
    int harness = strcmp(kind, "3") == 0;
    if (!harness && strcmp(kind, "1") != 0) goto fail;
    long argc = strtol(NEXT(), NULL, 10);
    if (argc < 1 || argc > 65536) goto fail;
    argv = calloc((size_t)argc + 1, sizeof(char *));
    if (!argv) goto fail;
    for (long i = 0; i < argc; i++) argv[i] = NEXT();
    long envc = strtol(NEXT(), NULL, 10);
    if (envc < 0 || envc > 65536) goto fail;
    envp = calloc((size_t)envc + 1, sizeof(char *));
    if (!envp) goto fail;
    for (long i = 0; i < envc; i++) envp[i] = NEXT();
    char *cwd = NEXT();
    long ncg = strtol(NEXT(), NULL, 10);
    if (ncg < 0 || ncg != nfds - 3) goto fail;
#undef NEXT

    pid_t pid = fork();
    if (pid < 0) goto fail;
    if (pid == 0) {
        sigset_t all;
        sigemptyset(&all);
        sigprocmask(SIG_SETMASK, &all, NULL);
        for (int s = 1; s < NSIG; s++) signal(s, SIG_DFL);
        setsid();
        for (int i = 3; i < nfds; i++) {
            if (write(fds[i], "0", 1) != 1) {
                dprintf(fds[2], "corral: cannot join exec cgroup: %s\n", strerror(errno));
                _exit(125);
            }
        }
        int oom = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
        if (oom >= 0) { ssize_t w = write(oom, "0", 1); (void)w; close(oom); }
        if (dup2(fds[0], 0) < 0 || dup2(fds[1], 1) < 0 || dup2(fds[2], 2) < 0) _exit(125);
        syscall(SYS_close_range, 3, ~0U, 0);
        if (drop_privileges(harness) != 0) {
            dprintf(2, "corral: cannot drop privileges: %s\n", strerror(errno));
            _exit(125);
        }
        if (chdir(cwd) != 0) {
            dprintf(2, "corral: cannot change directory to %s: %s\n", cwd, strerror(errno));
            _exit(126);
        }
        environ = envp;
        execvp(argv[0], argv);
        int e = errno;
        dprintf(2, "corral: cannot run %s: %s\n", argv[0], strerror(e));
        _exit(e == ENOENT ? 127 : 126);
    }
    for (int i = 0; i < nfds; i++) close(fds[i]);
    free(payload); free(argv); free(envp);
    reply_u32(conn, (uint32_t)pid);
    track(pid, conn);
    return;
fail:
    for (int i = 0; i < nfds; i++) close(fds[i]);
    free(payload); free(argv); free(envp);
    reply_u32(conn, 0);
    close(conn);
}

/* Limits every process of the sandbox inherits (services/node-agent .../oci.py rlimits): no core
 * dumps, at most MAX_NOFILE open files. runc sets them too where it can; in a sandbox with a user
 * namespace it cannot (its prlimit needs CAP_SYS_RESOURCE over that namespace), and lowering a
 * limit needs no privilege, so init sets them itself before anything else runs. */
#define MAX_NOFILE 65536
static int lower_limits(void) {
    struct rlimit core = {0, 0}, nofile;
    if (setrlimit(RLIMIT_CORE, &core) != 0 || getrlimit(RLIMIT_NOFILE, &nofile) != 0) return -1;
    if (nofile.rlim_max > MAX_NOFILE) nofile.rlim_max = MAX_NOFILE;
    if (nofile.rlim_cur > nofile.rlim_max) nofile.rlim_cur = nofile.rlim_max;
    return setrlimit(RLIMIT_NOFILE, &nofile);
}

/* gVisor: the token from `file` (then unlinked), and the listening socket at `path` as LISTEN_FD */
static int listen_at(const char *path, const char *file) {
    int t = open(file, O_RDONLY | O_CLOEXEC);
    if (t < 0) return -1;
    ssize_t n = read(t, token, TOKEN_MAX);
    close(t);
    if (n < 16 || unlink(file) != 0) return -1;
    token[n] = 0;
    if (strlen(token) != (size_t)n) return -1;
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof a.sun_path) return -1;
    strcpy(a.sun_path, path);
    int l = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (l < 0 || bind(l, (struct sockaddr *)&a, sizeof a) != 0 || listen(l, 256) != 0) return -1;
    if (l != LISTEN_FD && (dup3(l, LISTEN_FD, O_CLOEXEC) != LISTEN_FD || close(l) != 0)) return -1;
    return 0;
}

int main(int argc, char **argv) {
    /* keep /proc/1/fd and /proc/1/mem out of reach of the sandbox's own (capability-less) root */
    prctl(PR_SET_DUMPABLE, 0);
    if (lower_limits() != 0) return 111;
    if (argc == 4 && strcmp(argv[1], "--listen") == 0 && listen_at(argv[2], argv[3]) != 0) return 113;
    for (int fd = LISTEN_FD; fd <= HELD_FD_LAST; fd++) fcntl(fd, F_SETFD, FD_CLOEXEC);
    /* a placeholder keeps NOTIFY_FD's number from the fds opened below (a hold replaces it) */
    int ph = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (ph < 0 || (ph != NOTIFY_FD && (dup3(ph, NOTIFY_FD, O_CLOEXEC) != NOTIFY_FD || close(ph) != 0))) return 111;
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sfd < 0) return 111;
    struct pollfd pfd[2] = {{.fd = LISTEN_FD, .events = POLLIN}, {.fd = sfd, .events = POLLIN}};
    for (;;) {
        if (poll(pfd, 2, -1) < 0) {
            if (errno == EINTR) continue;
            return 111;
        }
        if (pfd[1].revents & POLLIN) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof si) == sizeof si) {}
            int status;
            pid_t pid;
            while ((pid = waitpid(-1, &status, WNOHANG)) > 0) finish(pid, status);
        }
        if (pfd[0].revents & POLLIN) {
            int conn = accept4(LISTEN_FD, NULL, NULL, SOCK_CLOEXEC);
            if (conn >= 0) spawn(conn);
        }
        if (pfd[0].revents & (POLLERR | POLLHUP | POLLNVAL)) return 112;
    }
}
