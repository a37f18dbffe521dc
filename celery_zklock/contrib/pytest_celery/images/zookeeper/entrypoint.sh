#!/bin/sh
# Writes zoo.cfg from the official image's variables, then runs ZooKeeper in the foreground.
# "zookeeper: serving" is printed once the server answers as standalone, leader or follower:
# pytest-celery's container waits for that line.
set -eu
data=${ZOO_DATA_DIR:-/var/lib/zk/data}
conf=${ZOO_CONF_DIR:-/var/lib/zk/conf}
mkdir -p "$data" "$conf"
{
  echo "tickTime=${ZOO_TICK_TIME:-2000}"
  echo "initLimit=${ZOO_INIT_LIMIT:-10}"
  echo "syncLimit=${ZOO_SYNC_LIMIT:-5}"
  echo "maxSessionTimeout=${ZOO_MAX_SESSION_TIMEOUT:-40000}"
  echo "dataDir=$data"
  echo "clientPort=2181"
  echo "maxClientCnxns=${ZOO_MAX_CLIENT_CNXNS:-0}"
  echo "4lw.commands.whitelist=${ZOO_4LW_COMMANDS_WHITELIST:-*}"
  echo "admin.enableServer=false"
  echo "standaloneEnabled=${ZOO_STANDALONE_ENABLED:-true}"
  echo "reconfigEnabled=false"
  # Listen on every address of the container: its own server.N name may resolve elsewhere.
  echo "quorumListenOnAllIPs=true"
  for server in ${ZOO_SERVERS:-}; do echo "$server"; done
} > "$conf/zoo.cfg"
echo "${ZOO_MY_ID:-1}" > "$data/myid"
(
  while ! echo srvr | nc -w 1 127.0.0.1 2181 2>/dev/null | grep -qE '^Mode: (standalone|leader|follower)'; do
    sleep 0.2
  done
  echo "zookeeper: serving"
) &
cp=$(ls /usr/share/java/zookeeper.jar /usr/share/java/zookeeper-jute.jar /usr/share/java/netty-*.jar \
        /usr/share/java/slf4j-api.jar /usr/share/java/slf4j-simple.jar /usr/share/java/metrics-core.jar \
        /usr/share/java/commons-cli.jar /usr/share/java/snappy-java.jar /usr/share/java/log4j-1.2.jar \
        2>/dev/null | tr '\n' ':')
exec java ${JVMFLAGS:--Xmx256m} -cp "$cp" org.apache.zookeeper.server.quorum.QuorumPeerMain "$conf/zoo.cfg"
