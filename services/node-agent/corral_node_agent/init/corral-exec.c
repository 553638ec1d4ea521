/*
 * corral-exec: installs a sandbox's seccomp filter, already compiled, and execs the command.
 *
 * Why it exists: runc compiles the OCI seccomp profile with libseccomp in every container it
 * starts, ~11 ms of CPU per start here, which is 15% of a whole function call (function_filter.py
 * measures it). The function substrate starts one container per call with the same profile, so the
 * node captures the program runc compiled once (from a container runc started with that profile)
 * and gives it to this helper instead of the profile: same instructions, no compiler.
 *
 * It runs as the container's process, so after everything runc does (namespaces, mounts, pivot,
 * capability drop, no_new_privs) and before anything of the caller's: the filter is in place when
 * execve starts the command, as with runc's own seccomp, which it loads just before its execve.
 *
 *   corral-exec -- CMD ARGS...   fd 3: the filter (struct sock_filter[], read with pread and
 *                                closed, so the command never has it); exits 125 if the filter
 *                                cannot be installed, 127/126 if CMD cannot be run (with the
 *                                message corral-init and the function substrate give)
 *   corral-exec --hold           waits for EOF on stdin: the process the node reads runc's
 *                                filter from (ptrace PTRACE_SECCOMP_GET_FILTER)
 *
 * Statically linked, like corral-init: images such as busybox carry no libc.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#define FILTER_FD 3
#define MAX_INSNS 4096 /* BPF_MAXINSNS */

static int hold(void) {
    char buf[256];
    for (;;) {
        ssize_t n = read(0, buf, sizeof buf);
        if (n == 0) return 0;
        if (n < 0 && errno != EINTR) return 1;
    }
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "--hold") == 0) return hold();
    if (argc < 3 || strcmp(argv[1], "--") != 0) {
        dprintf(2, "corral-exec: usage: corral-exec -- CMD [ARGS...] | corral-exec --hold\n");
        return 125;
    }
    static struct sock_filter insns[MAX_INSNS + 1];
    size_t got = 0;
    for (;;) {
        ssize_t n = pread(FILTER_FD, (char *)insns + got, sizeof insns - got, (off_t)got);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            dprintf(2, "corral: cannot read the sandbox's seccomp filter: %s\n", strerror(errno));
            return 125;
        }
        if (n == 0) break;
        got += (size_t)n;
        if (got == sizeof insns) break;
    }
    close(FILTER_FD);
    if (got == 0 || got % sizeof insns[0] != 0 || got > MAX_INSNS * sizeof insns[0]) {
        dprintf(2, "corral: the sandbox's seccomp filter is malformed (%zu bytes)\n", got);
        return 125;
    }
    struct sock_fprog prog = {.len = (unsigned short)(got / sizeof insns[0]), .filter = insns};
    /* runc set no_new_privs already; asking again costs nothing and makes the load legal regardless */
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 ||
        syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog) != 0) {
        dprintf(2, "corral: cannot install the sandbox's seccomp filter: %s\n", strerror(errno));
        return 125;
    }
    execvp(argv[2], argv + 2);
    int e = errno;
    dprintf(2, "corral: cannot run %s: %s\n", argv[2], strerror(e));
    return e == ENOENT ? 127 : 126;
}
