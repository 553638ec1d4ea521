/* Calls the seccomp policy refuses without reporting (default deny, io_uring, vsock, odd
   personalities) and a few it must allow, printing "name errno" for each (0: it succeeded).
   Built static on the host by tests/integration/test_isolation.py. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/personality.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef AF_VSOCK
#define AF_VSOCK 40
#endif

static void report(const char *name, long r) { printf("%s %d\n", name, r < 0 ? errno : 0); fflush(stdout); }

int main(void) {
    char params[120];
    memset(params, 0, sizeof params);
    /* not on the allowlist: succeeds for an unprivileged process on a plain kernel */
    errno = 0; report("get_mempolicy", syscall(SYS_get_mempolicy, NULL, NULL, 0, NULL, 0));
    errno = 0; report("io_uring_setup", syscall(SYS_io_uring_setup, 4, params));
    errno = 0; report("socket_vsock", socket(AF_VSOCK, SOCK_STREAM, 0));
    errno = 0; report("personality_no_randomize", syscall(SYS_personality, ADDR_NO_RANDOMIZE));
    /* allowed */
    errno = 0; report("personality_query", syscall(SYS_personality, 0xffffffff));
    errno = 0; report("socket_unix", socket(AF_UNIX, SOCK_STREAM, 0));
    errno = 0; report("getpid", syscall(SYS_getpid));
#if defined(__x86_64__)
    /* getpid through the i386 ABI (int 0x80, eax 20): not an architecture the filter accepts:
       the kernel kills the process (SIGSYS), so this comes last */
    long r;
    __asm__ volatile ("int $0x80" : "=a"(r) : "a"(20L) : "memory");
    printf("i386_getpid %ld\n", r < 0 ? -r : 0L); fflush(stdout);
#endif
    return 0;
}
