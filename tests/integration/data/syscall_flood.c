/* Calls a denied-and-audited syscall (keyctl) in a tight loop for argv[1] seconds; prints how
 * many calls were made and how many failed with EPERM. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    double secs = argc > 1 ? atof(argv[1]) : 2.0, t0 = now();
    long calls = 0, eperm = 0;
    while (now() - t0 < secs) {
        if (syscall(SYS_keyctl, 0, 0, 0, 0, 0) < 0 && errno == EPERM) eperm++;
        calls++;
    }
    printf("%ld %ld %.3f\n", calls, eperm, now() - t0);
    return 0;
}
