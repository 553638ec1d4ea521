/* Tries to connect to each AF_UNIX path given; prints "<path> ok" or "<path> <errno name>".
 * Static, for sandbox images without a libc (the gvisor control-channel test). */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        int s = socket(AF_UNIX, SOCK_STREAM, 0);
        struct sockaddr_un a = {.sun_family = AF_UNIX};
        strncpy(a.sun_path, argv[i], sizeof a.sun_path - 1);
        if (connect(s, (struct sockaddr *)&a, sizeof a) == 0) printf("%s ok\n", argv[i]);
        else printf("%s %s\n", argv[i], errno == EPERM ? "EPERM" : errno == ENOENT ? "ENOENT" : errno == EACCES ? "EACCES"
                    : errno == ECONNREFUSED ? "ECONNREFUSED" : "other");
        close(s);
    }
    return 0;
}
