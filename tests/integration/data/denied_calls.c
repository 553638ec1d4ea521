/* Calls every syscall the sandbox's seccomp policy denies and prints "name errno" for each
   (errno 0: the call succeeded). Built static on the host by tests/integration/test_audit_sources.py. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/fiemap.h>
#include <linux/fs.h>
#include <linux/fsmap.h>
#include <linux/perf_event.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/ptrace.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

static void report(const char *name, long r) { printf("%s %d\n", name, r < 0 ? errno : 0); fflush(stdout); }

int main(void) {
    char buf[4096];
    errno = 0; report("ptrace", ptrace(PTRACE_ATTACH, 1, 0, 0));
    struct iovec local = {buf, 16}, remote = {(void *)0x400000, 16};
    errno = 0; report("process_vm_readv", process_vm_readv(1, &local, 1, &remote, 1, 0));
    struct file_handle *fh = calloc(1, sizeof(*fh) + 128);
    fh->handle_bytes = 128;
    int mount_id;
    errno = 0; report("name_to_handle_at", name_to_handle_at(AT_FDCWD, "/", fh, &mount_id, 0));
    int dirfd = open("/", O_RDONLY | O_DIRECTORY);
    errno = 0; report("open_by_handle_at", open_by_handle_at(dirfd, fh, O_RDONLY));
    errno = 0; report("bpf", syscall(SYS_bpf, 0, NULL, 0));
    struct perf_event_attr attr; memset(&attr, 0, sizeof attr);
    attr.size = sizeof attr; attr.type = PERF_TYPE_SOFTWARE; attr.config = PERF_COUNT_SW_CPU_CLOCK;
    errno = 0; report("perf_event_open", syscall(SYS_perf_event_open, &attr, 0, -1, -1, 0));
    errno = 0; report("keyctl", syscall(SYS_keyctl, 0, -3, 0));
    errno = 0; report("userfaultfd", syscall(SYS_userfaultfd, 0));
    int fd = open("/bin/busybox", O_RDONLY);
    struct fiemap *fm = calloc(1, sizeof(*fm) + 8 * sizeof(struct fiemap_extent));
    fm->fm_length = ~0ULL; fm->fm_extent_count = 8;
    errno = 0; report("FS_IOC_FIEMAP", ioctl(fd, FS_IOC_FIEMAP, fm));
    struct fsmap_head *fsm = calloc(1, sizeof(*fsm) + 8 * sizeof(struct fsmap));
    fsm->fmh_count = 8; fsm->fmh_keys[1].fmr_device = ~0U; fsm->fmh_keys[1].fmr_physical = ~0ULL;
    errno = 0; report("FS_IOC_GETFSMAP", ioctl(fd, FS_IOC_GETFSMAP, fsm));
    /* ioctl's request is an int: the same FIEMAP with the upper half set must still be denied */
    errno = 0; report("FS_IOC_FIEMAP_HIGH", syscall(SYS_ioctl, fd, 0xFFFFFFFF00000000UL | FS_IOC_FIEMAP, fm));
    errno = 0; report("mount", mount("x", "/mnt", "tmpfs", 0, NULL));
    errno = 0; report("unshare", unshare(CLONE_NEWNS));
    return 0;
}
