/* Use up the per-uid inotify watch budget (fs.inotify.max_user_watches) from inside a sandbox:
 * make `files` files in `dir`, then with up to `instances` inotify instances watch every file
 * from each until the kernel says ENOSPC (the uid's budget is spent). Prints
 * "watches=<n> enospc=<0|1>", then, with "hold", sleeps holding them until killed.
 * usage: inotify_watches DIR FILES INSTANCES [hold] */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc < 4) return 2;
    const char *dir = argv[1];
    int files = atoi(argv[2]), instances = atoi(argv[3]);
    char path[4096];
    mkdir(dir, 0755);
    for (int i = 0; i < files; i++) {
        snprintf(path, sizeof path, "%s/%d", dir, i);
        int fd = open(path, O_CREAT | O_WRONLY, 0644);
        if (fd < 0) { perror("open"); return 3; }
        close(fd);
    }
    long watches = 0;
    int enospc = 0;
    for (int k = 0; k < instances && !enospc; k++) {
        int in = inotify_init1(IN_CLOEXEC);
        if (in < 0) { fprintf(stderr, "inotify_init1: %s\n", strerror(errno)); break; }
        for (int i = 0; i < files; i++) {
            snprintf(path, sizeof path, "%s/%d", dir, i);
            if (inotify_add_watch(in, path, IN_MODIFY) < 0) {
                if (errno == ENOSPC) { enospc = 1; break; }
                fprintf(stderr, "inotify_add_watch: %s\n", strerror(errno));
                return 4;
            }
            watches++;
        }
    }
    printf("watches=%ld enospc=%d\n", watches, enospc);
    fflush(stdout);
    if (argc > 4 && strcmp(argv[4], "hold") == 0) pause();
    return 0;
}
