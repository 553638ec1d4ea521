#!/bin/sh
# corral's microvm guest agent: one line per request on the virtio-serial port "corral", one line
# per answer; binary fields are base64 behind a "-" (so that an empty one is still a field), or,
# in a request, "=N": N raw bytes that follow its line (a request has one such field at most).
#   X id timeout max -script -stdin stream   run the script (its own process group) -> D id rc
#                                     timed_out out_size err_size -out -err oom (each output cut to
#                                     max bytes; oom: how many of its processes the OOM killer ended);
#                                     with stream=1, before it: O id o|e -bytes as output appears
#   S id name timeout max stream -start -pre -cmd -stdin uid   the same in session `name`: a shell
#                                     that stays (started by the script -start when there is none),
#                                     in which `{ pre && . cmd; } < stdin` runs -> D as for X; a
#                                     timeout kills the session (the next call starts a new one);
#                                     the call's files are uid's (the session's user)
#   K id                              kill exec id's processes (no answer: its D says so)
#   R id max -path                    read a regular file inside the root -> F id rc mode -data
#                                     (rc 0 read, 1 no such file, 2 a directory, 3 refused, 4 not regular)
#   W id mode parents -path -data     write one                   -> F id rc 0 -error
#   U id                              the writable layer, with the sandbox's processes frozen:
#                                     -> C id t -b64 lines (a tar of it), C id o -b64 lines (the
#                                     opaque directories, NUL-separated), then T id rc
#   G id rate burst -list             guard the sandbox's protected paths and canaries (LIST:
#                                     NUL-terminated "p/path", "c/path"; init/corral-guest.c) and,
#                                     with rate > 0, report its file activity -> F id rc 0 -error
#                                     once every mark is set (a guard running already is replaced
#                                     then); its reports: E 0 kind pid denied who -comm -path
#   Q id                              -> P id once the guard has handed on every event before it
#   P id                              -> P id (the host's "are you there")
# Answers go out whole, one at a time, through one writer; requests are served concurrently.
# The host may go away and come back (a node-agent restart): the port reads end-of-file while no
# host is connected, and a request it cut off is dropped (a short raw field, a line without its
# end); answers written meanwhile wait in the port for the next host.
# Every exec runs in a cgroup of its own under the sandbox's (which holds pids_max), every session
# in one of its own: a timeout or a kill ends all that it started, however it daemonised.
R=/run/corral
CG=/sys/fs/cgroup/sandbox
mkdir -p $R
# the sandbox exhausting the guest's memory must not end the agent: the OOM killer passes over it
# (corral-guest gives each command the default back)
echo -1000 > /proc/self/oom_score_adj
port=""
for p in /sys/class/virtio-ports/*; do
    [ "$(cat "$p/name")" = corral ] && port=/dev/$(basename "$p")
done
[ -n "$port" ] || { echo "corral-agent: no virtio-serial port named corral"; exit 1; }
exec 3<>"$port"
mkfifo $R/q $R/gctl
( exec 4<>$R/q; while read -r f <&4; do cat "$f" >&3; rm -f "$f"; done ) &
send() { # file: hand a finished answer to the writer
    mv "$1" "$1.out"
    echo "$1.out" > $R/q
}
take() { # id field: a raw field's bytes (=N) off the port into a file, named as "@file" for field();
    # "!" if the host went away before all N came
    case "$2" in
        =*)
            n=${2#=}
            f=$R/p$1
            : > "$f"
            # exactly N bytes: whole blocks, then the rest (a read of a block may not go past them)
            [ "$n" -ge 65536 ] && dd bs=65536 count=$((n / 65536)) iflag=fullblock 2>/dev/null <&3 >> "$f"
            [ $((n % 65536)) -gt 0 ] && dd bs=$((n % 65536)) count=1 iflag=fullblock 2>/dev/null <&3 >> "$f"
            if [ "$(wc -c < "$f")" = "$n" ]; then echo "@$f"; else rm -f "$f"; echo "!"; fi ;;
        *) echo "$2" ;;
    esac
}
field() { # field file: a request's bytes field into file
    case "$1" in
        @*) mv "${1#@}" "$2" ;;
        *) echo "${1#-}" | base64 -d > "$2" ;;
    esac
}
# the node's file operations: root, but in the sandbox's namespaces and root, where its symlinks
# and /proc lead nowhere else
inroot() { /bin/corral-guest enter --files /run/corral-holder.pid -- /.corral/busybox "$@"; }
# An exec's own state (what was streamed, the marks) is kept in $R/x<id>, which only the agent
# reaches: a session's output dir is one the sandbox may write in, and a link it planted there
# would be followed by whatever the agent wrote or read in it.
stream() { # id dir max: what exec id wrote (dir/o, dir/e) since the last look, each up to max bytes
    for sn in o e; do
        n=$(wc -c < "$2/$sn")
        k=$(cat "$R/x$1/$sn.n" 2>/dev/null || echo 0)
        [ "$n" -gt "$3" ] && n=$3
        if [ "$n" -gt "$k" ]; then
            printf 'O %s %s -%s\n' "$1" "$sn" "$(tail -c +$((k + 1)) "$2/$sn" | head -c $((n - k)) | base64 -w0)" > "$R/c$1$sn$k"
            echo "$n" > "$R/x$1/$sn.n"
            send "$R/c$1$sn$k"
        fi
    done
}
run() {
    d=$R/x$1
    mkdir -p "$d"
    echo "${4#-}" | base64 -d > "$d/s"
    field "$5" "$d/i"
    cg=$CG/x$1
    mkdir -p "$cg"
    echo "$cg" > "$d/cg"
    setsid sh -c 'echo $$ > "$1/cgroup.procs" || exit 125; exec sh "$2"' corral-exec "$cg" "$d/s" < "$d/i" > "$d/o" 2> "$d/e" &
    p=$!
    echo "$p" > "$d/p"
    streamer "$1" "$d" "$3" "$6"
    ( trap 'kill $s 2>/dev/null; exit 0' TERM; sleep "$2" & s=$!; wait $s; : > "$d/t"; killall_ "$p" "$cg" ) &
    w=$!
    wait "$p"
    rc=$?
    kill "$w" 2>/dev/null
    wait "$w" 2>/dev/null
    t=0; [ -e "$d/t" ] && t=1
    answer "$1" "$rc" "$t" "$d" "$3" "$st" "$(oomkills "$cg")"
}
oomkills() { # cgroup: how many of its processes the OOM killer has ended
    n=$(sed -n 's/^oom_kill //p' "$1/memory.events" 2>/dev/null)
    echo "${n:-0}"
}
answer() { # id rc timed_out dir max streamer oom: the last of the output, then D
    if [ -n "$6" ]; then : > "$R/x$1/z"; wait "$6"; stream "$1" "$4" "$5"; fi
    printf 'D %s %s %s %s %s -%s -%s %s\n' "$1" "$2" "$3" "$(wc -c < "$4/o")" "$(wc -c < "$4/e")" \
        "$(head -c "$5" "$4/o" | base64 -w0)" "$(head -c "$5" "$4/e" | base64 -w0)" "${7:-0}" > "$R/a$1"
    rm -rf "$4" "$R/x$1"
    send "$R/a$1"
    # the cgroups of execs that are done, once what they left running has ended
    for c in "$CG"/x*; do [ -e "$R/${c##*/}" ] || rmdir "$c" 2>/dev/null; done
}
killall_() { # pgid cgroup: all in the cgroup, and the process group (the timer that calls this
    # is told to stop as soon as the exec's main process is gone: it ignores that from here on)
    trap '' TERM
    echo 1 > "$2/cgroup.kill" 2>/dev/null
    kill -KILL -- "-$1" 2>/dev/null
}
streamer() { # id dir max on: if on (1), stream in the background until $R/x<id>/z appears; its pid in $st
    st=""
    if [ "$4" = 1 ]; then
        ( while [ ! -e "$R/x$1/z" ]; do sleep 0.1; stream "$1" "$2" "$3"; done ) &
        st=$!
    fi
}
sess() {
    # the call's files inside the root, where the session's shell sees them
    d=/mnt/root/.corral/io/$1
    c=/.corral/io/$1
    s=$R/s$2
    cg=$CG/s$2
    mkdir -p "$d" "$R/x$1"
    : > "$d/o"
    : > "$d/e"
    field "$9" "$d/i"
    echo "${8#-}" | base64 -d > "$d/u"
    if [ ! -e "$s/p" ] || [ -e "$s/x" ] || ! kill -0 "$(cat "$s/p")" 2>/dev/null; then
        rm -rf "$s"
        mkdir -p "$s" "$cg"
        mkfifo "$s/q"
        echo "${10:-0}" > "$s/uid"
        echo "${6#-}" | base64 -d > "$s/start"
        # the session holds its FIFO open before the first call is written into it: a call
        # written while nobody has it open is dropped with the pipe when the writer closes it
        setsid sh -c 'echo $$ > "$2/cgroup.procs" || exit 125; exec 0<>"$1/q"; : > "$1/up"; sh "$1/start" >/dev/null 2>&1; '\
'echo $? > "$1/x.t"; mv "$1/x.t" "$1/x"' corral-session "$s" "$cg" &
        echo $! > "$s/p"
        while [ ! -e "$s/up" ] && kill -0 "$!" 2>/dev/null; do sleep 0.01; done
    fi
    # the call's files are the harness user's, in a dir under /.corral/io (a tmpfs the sandbox
    # cannot rename or write: init.sh): a harness session's dir is private to it; an agent
    # session's shell (root without a capability: "other" here) may write them but not replace
    # them with links (sticky), which the agent reading its output here would follow
    : > "$d/rc"
    chown -R 64222:64222 "$d"
    if [ "$(cat "$s/uid")" = 0 ]; then
        chmod 1733 "$d"; chmod 0622 "$d/o" "$d/e" "$d/rc"; chmod 0644 "$d/i" "$d/u"
    else
        chmod 0700 "$d"
    fi
    p=$(cat "$s/p")
    echo "$p" > "$R/x$1/p"
    echo "$cg" > "$R/x$1/cg"
    o0=$(oomkills "$cg")  # the session's group counts over its life: this call's are the difference
    # the status first, then the mark the agent waits for (shell built-ins only: images vary)
    printf '{ %s && . %s/u; } < %s/i > %s/o 2> %s/e; echo $? > %s/rc; : > %s/r\n' \
        "$(echo "${7#-}" | base64 -d)" "$c" "$c" "$c" "$c" "$c" "$c" 1<> "$s/q"  # read-write: never blocks
    ( trap 'kill $w 2>/dev/null; exit 0' TERM; sleep "$3" & w=$!; wait $w; : > "$R/x$1/t"; killall_ "$p" "$cg" ) &
    tm=$!
    streamer "$1" "$d" "$4" "$5"
    while [ ! -e "$d/r" ] && [ ! -e "$R/x$1/t" ] && [ ! -e "$s/x" ] && kill -0 "$p" 2>/dev/null; do sleep 0.02; done
    kill "$tm" 2>/dev/null
    wait "$tm" 2>/dev/null
    t=0
    if [ -e "$d/r" ] && [ ! -e "$R/x$1/t" ]; then
        rc=$(head -c 8 "$d/rc")  # written by the session's shell: only a number is taken
        case "$rc" in ''|*[!0-9]*) rc=1 ;; esac
    elif [ -e "$s/x" ]; then
        rc=$(cat "$s/x"); rm -rf "$s"  # the command ended the session's shell (exit)
    else  # timed out, or killed (K): the session goes with it
        t=1; rc=137; rm -rf "$s"
    fi
    answer "$1" "$rc" "$t" "$d" "$4" "$st" "$(($(oomkills "$cg") - o0))"
}
# files.read in a cgroup of its own: the guard reports what it opens that is guarded
inread() { sh -c 'echo $$ > /sys/fs/cgroup/read/cgroup.procs || exit 125; exec "$@"' corral-read \
    /bin/corral-guest enter --files /run/corral-holder.pid -- /.corral/busybox "$@"; }
readf() { # in one pass in the sandbox's view: its kind, then its mode and bytes
    p=$(echo "${3#-}" | base64 -d)
    inread sh -c '[ -e "$1" ] || exit 11; [ -d "$1" ] && exit 12; [ -f "$1" ] || exit 14; stat -L -c %a -- "$1" && exec head -c "$2" -- "$1"' \
        corral-read "$p" "$2" > "$R/r$1" 2>/dev/null
    case $? in
        0) m=$(head -n 1 "$R/r$1")
           printf 'F %s 0 %s -%s\n' "$1" "$m" "$(tail -c +$((${#m} + 2)) "$R/r$1" | base64 -w0)" > "$R/a$1" ;;
        11) echo "F $1 1 0 -" > "$R/a$1" ;;
        12) echo "F $1 2 0 -" > "$R/a$1" ;;
        14) echo "F $1 4 0 -" > "$R/a$1" ;;
        *) echo "F $1 3 0 -" > "$R/a$1" ;;  # there, but not to be read (a harness process's /proc entry)
    esac
    rm -f "$R/r$1"
    send "$R/a$1"
}
# A write goes through one descriptor (mode set on it, then the data), as on `container`: the
# sandbox removing or renaming the file meanwhile cannot fail it halfway.
writef() {
    p=$(echo "${4#-}" | base64 -d)
    field "$5" "$R/w$1"
    rc=0
    if [ "$3" = 1 ]; then inroot mkdir -p -- "$(dirname -- "$p")" 2> "$R/e$1" || rc=3; fi
    if [ "$rc" = 0 ]; then
        if ! inroot test -d "$(dirname -- "$p")"; then
            rc=1
        elif inroot test -e "$p" && ! inroot test -f "$p"; then
            rc=4
        elif ! inroot sh -c 'exec 4> "$1" && { chmod "$2" /proc/self/fd/4 2>/dev/null || chmod "$2" "$1"; } && cat >&4' corral-write "$p" "$2" < "$R/w$1" 2> "$R/e$1"; then
            rc=3
        fi
    fi
    printf 'F %s %s 0 -%s\n' "$1" "$rc" "$(base64 -w0 < "$R/e$1" 2>/dev/null)" > "$R/a$1"
    rm -f "$R/w$1" "$R/e$1"
    send "$R/a$1"
}
# fanotify fails open: a guard that ends (but by being replaced) powers the guest off, so nothing
# of the sandbox runs unguarded
guard() {
    g=$R/g$1
    field "$2" "$g.list"
    ( /bin/corral-guest guard /run/corral-holder.pid $R "$g.ready" "$3" "$4" < "$g.list" 2> "$g.err" &
      echo $! > "$g.pid"; wait $!
      if [ -e "$g.ready" ] && [ ! -e "$g.replaced" ]; then echo "corral-agent: the guard of protected paths ended"; poweroff -f; fi ) &
    while [ ! -e "$g.ready" ] && kill -0 $! 2>/dev/null; do sleep 0.01; done
    if [ -e "$g.ready" ]; then
        if [ -e $R/guard ]; then old=$(cat $R/guard); : > "$R/g$old.replaced"; kill "$(cat "$R/g$old.pid")"; fi
        echo "$1" > $R/guard
        printf 'F %s 0 0 -\n' "$1" > "$R/a$1"
    else
        printf 'F %s 3 0 -%s\n' "$1" "$(head -c 2000 "$g.err" | base64 -w0)" > "$R/a$1"
    fi
    send "$R/a$1"
}
frozen() { # 1|0: the sandbox's processes (every exec's and session's cgroup is under $CG) frozen or thawed
    echo "$1" > "$CG/cgroup.freeze"
    until [ "$(sed -n 's/^frozen //p' "$CG/cgroup.events")" = "$1" ]; do sleep 0.01; done
}
# The answer is a FIFO the writer streams from as it is filled: a writable layer can be as large
# as the guest's disk_mb, more than its RAM could hold twice.
upper() {
    frozen 1
    mkfifo "$R/a$1"
    send "$R/a$1"
    (
        set -o pipefail
        rc=0
        tar -C /mnt/rw/upper -cf - . | base64 -w 49152 | sed "s/^/C $1 t -/" || rc=1
        /bin/corral-guest opaque /mnt/rw/upper | base64 -w 49152 | sed "s/^/C $1 o -/" || rc=1
        echo "T $1 $rc"
    ) > "$R/a$1.out"
    frozen 0
}
echo "H 0 ready" > $R/hello
send $R/hello
while :; do
    if ! read -r op id a b c d e f g h i <&3; then
        sleep 0.05  # no host (end-of-file), or a line it did not finish: wait for the next
        continue
    fi
    case "$op" in
        X) d=$(take "$id" "$d"); [ "$d" = "!" ] || run "$id" "$a" "$b" "$c" "$d" "$e" & ;;
        S) h=$(take "$id" "$h"); [ "$h" = "!" ] || sess "$id" "$a" "$b" "$c" "$d" "$e" "$f" "$g" "$h" "$i" & ;;
        K) [ -e "$R/x$id/p" ] && ( killall_ "$(cat "$R/x$id/p")" "$(cat "$R/x$id/cg")" ) ;;
        R) readf "$id" "$a" "$b" & ;;
        W) d=$(take "$id" "$d"); [ "$d" = "!" ] || writef "$id" "$a" "$b" "$c" "$d" & ;;
        G) c=$(take "$id" "$c"); [ "$c" = "!" ] || guard "$id" "$c" "$a" "$b" & ;;
        Q) if [ -e $R/guard ]; then echo "$id" > $R/gctl; else echo "P $id" > "$R/a$id"; send "$R/a$id"; fi ;;
        P) echo "P $id" > "$R/a$id"; send "$R/a$id" ;;
        U) upper "$id" & ;;
    esac
done
