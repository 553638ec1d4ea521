#!/bin/sh
# corral's microvm init: PID 1 of the guest, from the initramfs. Mounts the image's EROFS layers
# (virtio block devices whose serial is l0, l1, ... bottom first) under an overlay whose upper is a
# tmpfs of corral_disk MiB, caps the sandbox's processes at corral_pids and their memory at
# corral_mem MiB, starts the holder of the
# sandbox's namespaces (corral-guest), then runs the guest agent; the guest powers off when the
# agent ends.
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /lib/modules/order); do
    insmod "/lib/modules/$m" || echo "corral-init: insmod $m failed"
done
if grep -q corral_probe=1 /proc/cmdline; then echo corral-probe-ok; poweroff -f; fi
# where the boot got to, on the console (its end is in a failed create's error)
stage() { read -r up _ < /proc/uptime; echo "corral-init: $* (${up} s)"; }
stage "modules loaded"
arg() { sed -n "s/.*corral_$1=\([^ ]*\).*/\1/p" /proc/cmdline; }
fail() { echo "corral-init: $*"; poweroff -f; }
disk=$(arg disk)
layers=$(arg layers)
hostname "$(arg host)"
mkdir -p /mnt/rw /mnt/root
mount -t tmpfs -o "size=${disk}m,mode=0755" rw /mnt/rw || fail "no tmpfs for the writable layer"
mkdir /mnt/rw/upper /mnt/rw/work
lower=""
i=0
while [ "$i" -lt "$layers" ]; do
    dev=""
    for s in /sys/block/vd*/serial; do
        [ "$(cat "$s")" = "l$i" ] && dev=$(basename "$(dirname "$s")")
    done
    [ -n "$dev" ] || fail "layer l$i has no block device"
    mkdir "/mnt/l$i"
    mount -t erofs -o ro "/dev/$dev" "/mnt/l$i" || fail "cannot mount layer l$i ($dev)"
    lower="/mnt/l$i${lower:+:$lower}"
    i=$((i + 1))
done
stage "layers mounted"
mount -t overlay root -o "lowerdir=$lower,upperdir=/mnt/rw/upper,workdir=/mnt/rw/work" /mnt/root || fail "no overlay root"
cd /mnt/root || fail "no root"
mkdir -p proc sys dev tmp .corral
chmod 1777 tmp
mount -t proc proc proc
mount -t sysfs sys sys
mount -t devtmpfs dev dev
# corral's own files in the root (session calls' files, the busybox the node's file operations
# run) on a tmpfs of their own: a mount point the sandbox cannot rename away and replace with a
# directory of its making, owned by the harness's user so that the agent's commands (root without
# a capability) cannot write or list it
mount -t tmpfs -o "size=${disk}m,mode=0711,uid=64222,gid=64222" corral .corral || fail "no tmpfs for /.corral"
touch .corral/busybox
mount --bind /bin/busybox .corral/busybox
mount -o remount,bind,ro .corral/busybox  # the agent runs it as the guest's root: the sandbox must not write it
cd /
# pids_max binds the sandbox's processes (every exec joins this group), not the agent
mkdir -p /sys/fs/cgroup
mount -t cgroup2 cgroup /sys/fs/cgroup || fail "no cgroup2"
# memory_mb binds the sandbox's processes (what they write to its tmpfs included, as a container's
# writes to its upper are charged to it), not the guest: the agent and its files.write stay
# outside; memory.events counts the processes the OOM killer ends in each exec's group
echo "+pids +memory" > /sys/fs/cgroup/cgroup.subtree_control
mkdir /sys/fs/cgroup/sandbox
echo +memory > /sys/fs/cgroup/sandbox/cgroup.subtree_control || fail "no memory controller"
echo "$(arg pids)" > /sys/fs/cgroup/sandbox/pids.max || fail "cannot set pids.max"
echo "$(($(arg mem) * 1048576))" > /sys/fs/cgroup/sandbox/memory.max || fail "cannot set memory.max"
echo 0 > /sys/fs/cgroup/sandbox/memory.swap.max 2>/dev/null
mkdir /sys/fs/cgroup/read  # the agent's files.read (the guard reports its opens: agent.sh)
mkdir -p /mnt/root/.corral/io
chown 64222:64222 /mnt/root/.corral/io && chmod 0711 /mnt/root/.corral/io || fail "no io dir"
# the sandbox's PID and mount namespaces (its own /proc), which every command enters (corral-guest)
/bin/corral-guest hold /run/corral-holder.pid /mnt/root || fail "no namespace holder for the sandbox"
stage "agent starting"
/bin/sh /agent.sh
fail "the guest agent ended"
