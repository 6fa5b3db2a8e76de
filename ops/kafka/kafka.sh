#!/usr/bin/env bash
# A real single-node Apache Kafka broker (KRaft, combined broker+controller) for development,
# tests and CI, run from Maven Central jars on the local JVM: no Docker, no tarball.
#
#   kafka.sh fetch                          copy the pinned broker jars into ops/kafka/lib (idempotent)
#   kafka.sh start DIR                      format DIR (first time) and start the broker in the background;
#                                           prints the bootstrap address, also written to DIR/bootstrap
#   kafka.sh stop DIR                       SIGTERM, wait, SIGKILL fallback
#   kafka.sh topics DIR name:partitions[:compact] ...   create topics if missing
#
# The single broker is the one-node case of the cluster below, kept in DIR itself (not DIR/node-1)
# and given fresh loopback ports at every start.
#
# A replicated cluster of N nodes (default 3), each a combined broker+controller, all N voters of
# one KRaft quorum, on loopback ports chosen once and kept (a restarted node comes back on its own
# address, so clients holding the bootstrap list find it again):
#
#   kafka.sh cluster start DIR [N]          format DIR/node-1..N (first time), start every node; prints the
#                                           bootstrap list, also written to DIR/bootstrap
#   kafka.sh cluster stop DIR               stop every node (SIGTERM to all together, SIGKILL fallback)
#   kafka.sh cluster node-stop DIR ID       controlled shutdown of one node (SIGTERM, wait)
#   kafka.sh cluster node-kill DIR ID       SIGKILL one node (a crash: no controlled shutdown)
#   kafka.sh cluster node-start DIR ID      start a stopped node again (same ports, same data)
#   kafka.sh cluster status DIR             one line per node: id, pid or "down", address
#   kafka.sh cluster topics DIR name:partitions[:compact] ...   create topics with replication
#                                           factor min(3, N) and min.insync.replicas min(2, N)
#   kafka.sh cluster describe DIR TOPIC     leader, replicas and ISR per partition (Kafka's TopicCommand)
#
# Environment: KAFKA_HEAP_OPTS (default -Xms128m -Xmx512m, per node), KAFKA_JVM_OPTS, KAFKA_START_TIMEOUT (s, default 60),
# KAFKA_STOP_TIMEOUT (s, default 30), KAFKA_OWNER_PID (stop the broker, or each node, when that process dies),
# KAFKA_M2_REPO (Maven local repository; default ~/.m2/repository).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
LIB="$HERE/lib"
STAMP="$LIB/.fetched"
START_TIMEOUT="${KAFKA_START_TIMEOUT:-60}"
STOP_TIMEOUT="${KAFKA_STOP_TIMEOUT:-30}"
# C1 only: a test broker lives for minutes, and C2's compiler threads slow startup on 2 busy cores
# (measured 8-10 s against 18 s under load). Serial GC: one small heap, no GC threads to spare.
JVM_OPTS="-XX:+UseSerialGC -XX:TieredStopAtLevel=1"

die() { echo "kafka.sh: $*" >&2; exit 1; }
log() { echo "kafka.sh: $*" >&2; }

pom_hash() { sha256sum "$HERE/pom.xml" | cut -d' ' -f1; }

cmd_fetch() {
  # Brokers started side by side (parallel test runs) must not swap lib/ under each other.
  exec 9> "${TMPDIR:-/tmp}/prism-kafka-fetch.lock"
  flock 9
  # The stamp holds the pom's hash: while it matches, lib/ is complete and mvn is not run at all.
  if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$(pom_hash)" ]]; then
    log "lib/ is up to date ($(find "$LIB" -name '*.jar' | wc -l) jars); nothing to fetch"
    exec 9>&-
    return 0
  fi
  command -v mvn >/dev/null || die "mvn not found: install Maven 3 (e.g. apt-get install maven)"
  command -v java >/dev/null || die "java not found: install a JDK >= 17"
  local repo_opt=()
  [[ -n "${KAFKA_M2_REPO:-}" ]] && repo_opt=("-Dmaven.repo.local=$KAFKA_M2_REPO")
  log "fetching broker jars with Maven into $LIB"
  # Build into a scratch folder and swap it in, so an interrupted fetch never leaves a half lib/.
  local tmp; tmp="$(mktemp -d "${TMPDIR:-/tmp}/prism-kafka-lib.XXXXXX")"
  local mvn_args=(-B -q -ntp -Dstyle.color=never -f "$HERE/pom.xml" "${repo_opt[@]}"
    dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$tmp/lib")
  # Offline first: with the Maven repository already warm nothing is downloaded at all.
  if mvn -o "${mvn_args[@]}" > "$tmp/offline.log" 2>&1; then
    log "resolved from the local Maven repository (offline)"
  else
    # Online: a dropped connection to Maven Central is retried (Maven keeps what it already has).
    local attempt
    for attempt in 1 2 3 4; do
      mvn "${mvn_args[@]}" >&2 && break
      if ((attempt == 4)); then
        rm -rf "$tmp"
        die "mvn dependency:copy-dependencies failed 4 times (see the output above)"
      fi
      log "mvn failed (attempt $attempt of 4); retrying in $((attempt * 20)) s"
      sleep $((attempt * 20))
    done
  fi
  pom_hash > "$tmp/lib/.fetched"
  rm -rf "$LIB"
  mv "$tmp/lib" "$LIB"
  rm -rf "$tmp"
  log "fetched $(find "$LIB" -name '*.jar' | wc -l) jars"
  exec 9>&-
}

# A free loopback TCP port, chosen by the kernel. Another process may take it before the broker
# binds; start retries with fresh ports when that happens.
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# True while any thread of PID still runs. Neither kill -0 nor /proc/PID/cmdline tells: a zombie
# (an exited child not yet reaped) answers kill -0, and the JVM's main thread exits first on
# SIGTERM, which empties cmdline while the shutdown hooks still run in other threads.
pid_alive() {
  local stat line
  for stat in /proc/"$1"/task/*/stat; do
    [[ -e "$stat" ]] && read -r line 2>/dev/null < "$stat" || continue
    line="${line##*) }"
    [[ "${line:0:1}" != Z ]] && return 0
  done
  return 1
}

# True when PID is alive and is the broker started for DIR (guards against a recycled pid).
is_our_broker() {
  local pid="$1" dir="$2" cmdline
  [[ -n "$pid" ]] && pid_alive "$pid" || return 1
  cmdline="$(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null)" || return 1
  [[ "$cmdline" == *"kafka.Kafka $dir/server.properties"* ]]
}
# ---- nodes: what the single broker and every cluster node share ---------------------------------
#
# The single broker (`kafka.sh start|stop|topics DIR`) is a one-node cluster whose one node lives
# in DIR itself (DIR/server.properties, DIR/pid, DIR/logs: the layout its callers read), where
# node ID of a cluster lives in DIR/node-ID. Config, format, launch, readiness, shutdown and topic
# creation are the same code for both; the single-broker commands set SINGLE_BROKER=1.
SINGLE_BROKER=0

node_dir() {
  if (( SINGLE_BROKER )); then echo "$1"; else echo "$1/node-$2"; fi
}

# The folder of a cluster (or of the single broker), made if missing, as an absolute path.
cluster_dir() {
  [[ -n "${1:-}" ]] || die "usage: kafka.sh cluster COMMAND DIR ..."
  mkdir -p "$1"
  (cd "$1" && pwd)
}

# N of an existing cluster: the node folders that have a config (0: none yet).
cluster_size() {
  local dir="$1" n=0
  if (( SINGLE_BROKER )); then
    [[ -f "$dir/server.properties" ]] && n=1
  else
    while [[ -f "$dir/node-$((n + 1))/server.properties" ]]; do n=$((n + 1)); done
  fi
  echo "$n"
}

# DIR/ports holds broker.ID=PORT and controller.ID=PORT lines, chosen at the first start.
node_port() { sed -n "s/^$2=\([0-9]*\)$/\1/p" "$1/ports"; }

# Node ID's config. Every node is a broker and a controller, and the quorum is all N nodes (static
# voters), so with three any one may die and the other two still elect a controller and leaders.
write_node_config() {
  local dir="$1" id="$2" n="$3" voters="$4" node; node="$(node_dir "$1" "$2")"
  local port cport rf isr io_threads
  port="$(node_port "$dir" "broker.$id")"; cport="$(node_port "$dir" "controller.$id")"
  rf=$(( n < 3 ? n : 3 )); isr=$(( n < 2 ? n : 2 ))
  # N nodes share the machine's cores: a lone broker takes 4 I/O threads, a cluster's nodes 2 each.
  io_threads=$(( n == 1 ? 4 : 2 ))
  mkdir -p "$node/logs" "$node/data"
  cat > "$node/server.properties" <<EOC
# Generated by ops/kafka/kafka.sh: node $id of a local $n-node cluster, combined broker and
# controller, loopback only.
process.roles=broker,controller
node.id=$id
controller.quorum.voters=$voters
listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$cport
advertised.listeners=PLAINTEXT://127.0.0.1:$port
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs=$node/data
num.partitions=1
# What a production cluster runs: every partition on 3 nodes, a write acknowledged (acks=all)
# only once 2 in-sync replicas have it, and no out-of-sync replica ever elected leader (on one
# node: 1 and 1, what development needs).
default.replication.factor=$rf
min.insync.replicas=$isr
unclean.leader.election.enable=false
offsets.topic.replication.factor=$rf
# Few internal partitions: the defaults (50 each) make the first group and transaction slow.
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=$rf
transaction.state.log.min.isr=$isr
transaction.state.log.num.partitions=4
share.coordinator.state.topic.replication.factor=$rf
share.coordinator.state.topic.min.isr=$isr
# A single member joins at once; the 3 s default only helps large groups settle.
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=true
# A killed node is fenced (its partitions move to other leaders) after this long without a
# heartbeat to the controller: Kafka's 9 s default, kept (shorter fences live nodes on busy cores).
broker.session.timeout.ms=9000
num.network.threads=2
num.io.threads=$io_threads
num.replica.fetchers=1
EOC
  cat > "$node/log4j2.properties" <<EOC
status = warn
appender.server.type = File
appender.server.name = server
appender.server.fileName = $node/logs/server.log
appender.server.layout.type = PatternLayout
appender.server.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.server.ref = server
logger.state.name = state.change.logger
logger.state.level = WARN
EOC
  # The one-shot tools (format, topics) only report problems, on stderr.
  cat > "$node/tools-log4j2.properties" <<EOC
status = warn
appender.err.type = Console
appender.err.name = err
appender.err.target = SYSTEM_ERR
appender.err.layout.type = PatternLayout
appender.err.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.err.ref = err
EOC
}

# Waits for the broker's "started" line and an open port; returns 1 if the JVM died, 2 on timeout.
wait_ready() {
  local node="$1" pid="$2" port="$3" deadline=$((SECONDS + START_TIMEOUT))
  while (( SECONDS < deadline )); do
    pid_alive "$pid" || return 1
    if grep -q "Kafka Server started" "$node/logs/server.log" 2>/dev/null \
        && (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      return 0
    fi
    sleep 0.2
  done
  return 2
}

log_tail() {
  local node="$1"
  echo "---- tail of $node/logs/server.log ----" >&2
  tail -n 40 "$node/logs/server.log" >&2 2>/dev/null || true
  echo "---- tail of $node/logs/stdout.log ----" >&2
  tail -n 20 "$node/logs/stdout.log" >&2 2>/dev/null || true
}

# Launches node ID's JVM in the background on the config, data and ports already written.
launch_node() {
  local node; node="$(node_dir "$1" "$2")"
  : > "$node/logs/server.log"
  # shellcheck disable=SC2086  # KAFKA_HEAP_OPTS is a list of JVM flags
  nohup java ${KAFKA_HEAP_OPTS:--Xms128m -Xmx512m} ${KAFKA_JVM_OPTS:-$JVM_OPTS} -Djava.awt.headless=true \
    -Dlog4j2.configurationFile="$node/log4j2.properties" -Dkafka.logs.dir="$node/logs" \
    -cp "$LIB/*" kafka.Kafka "$node/server.properties" \
    >> "$node/logs/stdout.log" 2>&1 < /dev/null &
  local pid=$!
  echo "$pid" > "$node/pid"
  if [[ -n "${KAFKA_OWNER_PID:-}" ]]; then
    # Watchdog: a test run killed with SIGKILL cannot stop its nodes, so stop them for it.
    nohup bash -c 'while kill -0 "$1" 2>/dev/null && kill -0 "$2" 2>/dev/null; do sleep 1; done
                   kill -TERM "$2" 2>/dev/null' _ "$KAFKA_OWNER_PID" "$pid" >/dev/null 2>&1 < /dev/null &
    echo $! > "$node/watchdog.pid"
  fi
}

node_running() {
  local node; node="$(node_dir "$1" "$2")"
  [[ -f "$node/pid" ]] && is_our_broker "$(cat "$node/pid")" "$node"
}

# Stops PID, known to be a broker: SIGTERM (controlled shutdown), then SIGKILL after the timeout.
stop_pid() {
  local pid="$1" deadline=$((SECONDS + STOP_TIMEOUT))
  kill -TERM "$pid" 2>/dev/null || return 0
  while pid_alive "$pid" && (( SECONDS < deadline )); do sleep 0.1; done
  if pid_alive "$pid"; then
    log "broker pid $pid ignored SIGTERM for ${STOP_TIMEOUT}s; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    while pid_alive "$pid"; do sleep 0.1; done
  fi
}

end_watchdog() {
  local node; node="$(node_dir "$1" "$2")"
  if [[ -f "$node/watchdog.pid" ]]; then
    kill -TERM "$(cat "$node/watchdog.pid")" 2>/dev/null || true
    rm -f "$node/watchdog.pid"
  fi
}

# Ends node ID with SIGTERM (controlled shutdown, SIGKILL after the timeout) or SIGKILL (a crash).
end_node() {
  local dir="$1" id="$2" sig="$3" node; node="$(node_dir "$1" "$2")"
  end_watchdog "$dir" "$id"
  if node_running "$dir" "$id"; then
    local pid; pid="$(cat "$node/pid")"
    if [[ "$sig" == KILL ]]; then
      kill -KILL "$pid" 2>/dev/null || true
      while pid_alive "$pid"; do sleep 0.1; done
      log "node $id (pid $pid) killed"
    else
      stop_pid "$pid"
      log "node $id (pid $pid) stopped"
    fi
  fi
  rm -f "$node/pid"
}

cluster_bootstrap() {
  local dir="$1" n="$2" i out=()
  for ((i = 1; i <= n; i++)); do out+=("127.0.0.1:$(node_port "$dir" "broker.$i")"); done
  local IFS=,; echo "${out[*]}"
}

# Formats (first time) and starts all N nodes of DIR; prints the bootstrap list, also written to
# DIR/bootstrap. PORTS is `keep` (a cluster: the ports chosen at its first start are kept, so a
# restarted node comes back where clients look) or `renew` (the single broker: fresh ports at
# every start, because its kept work dir may start again long after another process took them).
start_nodes() {
  local dir="$1" n="$2" ports="$3" i
  for ((i = 1; i <= n; i++)); do
    node_running "$dir" "$i" \
      && die "node $i of $dir is already running (pid $(cat "$(node_dir "$dir" "$i")/pid"), $(cat "$dir/bootstrap" 2>/dev/null))"
  done
  [[ "$ports" == renew ]] && rm -f "$dir/ports"
  local fresh=0
  [[ -f "$dir/ports" ]] || fresh=1
  cmd_fetch
  local started=$SECONDS attempt
  for attempt in 1 2 3; do
    if [[ ! -f "$dir/ports" ]]; then
      # 2N distinct free ports: a broker and a controller listener per node.
      local chosen=() p
      while (( ${#chosen[@]} < 2 * n )); do
        p="$(free_port)"
        [[ " ${chosen[*]} " == *" $p "* ]] || chosen+=("$p")
      done
      : > "$dir/ports.tmp"
      for ((i = 1; i <= n; i++)); do
        echo "broker.$i=${chosen[$((2 * i - 2))]}" >> "$dir/ports.tmp"
        echo "controller.$i=${chosen[$((2 * i - 1))]}" >> "$dir/ports.tmp"
      done
      mv "$dir/ports.tmp" "$dir/ports"
    fi
    local voters=() voter_list cluster_id
    for ((i = 1; i <= n; i++)); do voters+=("$i@127.0.0.1:$(node_port "$dir" "controller.$i")"); done
    voter_list="$(IFS=,; echo "${voters[*]}")"
    if [[ -f "$dir/cluster.id" ]]; then
      cluster_id="$(cat "$dir/cluster.id")"
    else
      # A cluster id is 16 random bytes in unpadded url-safe base64 (what `random-uuid` prints).
      cluster_id="$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=')"
      echo "$cluster_id" > "$dir/cluster.id"
    fi
    for ((i = 1; i <= n; i++)); do
      write_node_config "$dir" "$i" "$n" "$voter_list"
      local node; node="$(node_dir "$dir" "$i")"
      if [[ ! -f "$node/data/meta.properties" ]]; then
        java -Xmx256m $JVM_OPTS -cp "$LIB/*" -Dlog4j2.configurationFile="$node/tools-log4j2.properties" \
          kafka.tools.StorageTool format --config "$node/server.properties" --cluster-id="$cluster_id" \
          > "$node/logs/format.log" 2>&1 || { cat "$node/logs/format.log" >&2; die "formatting $node failed"; }
      fi
      # This attempt's output only: the port check below must not read an earlier start's.
      : > "$node/logs/stdout.log"
    done
    # Every node at once: a node's broker waits for the quorum, which needs a majority of voters.
    for ((i = 1; i <= n; i++)); do launch_node "$dir" "$i"; done
    local failed="" rc
    for ((i = 1; i <= n; i++)); do
      rc=0
      wait_ready "$(node_dir "$dir" "$i")" "$(cat "$(node_dir "$dir" "$i")/pid")" \
        "$(node_port "$dir" "broker.$i")" || rc=$?
      if (( rc != 0 )); then failed="$i:$rc"; break; fi
    done
    if [[ -z "$failed" ]]; then
      cluster_bootstrap "$dir" "$n" > "$dir/bootstrap"
      log "$n-node cluster ready at $(cat "$dir/bootstrap") in $((SECONDS - started))s (logs: $(node_dir "$dir" '*')/logs)"
      cat "$dir/bootstrap"
      return 0
    fi
    local bad="${failed%%:*}" logs=()
    log_tail "$(node_dir "$dir" "$bad")"
    for ((i = 1; i <= n; i++)); do
      end_node "$dir" "$i" KILL
      node="$(node_dir "$dir" "$i")"; logs+=("$node/logs/server.log" "$node/logs/stdout.log")
    done
    if (( fresh )) && grep -q "Address already in use" "${logs[@]}" 2>/dev/null; then
      log "a port was taken before node $bad bound it (attempt $attempt); retrying with new ports"
      rm -f "$dir/ports"
      continue
    fi
    die "node $bad did not become ready (${failed#*:}: 1 = exited, 2 = no start within ${START_TIMEOUT}s)"
  done
  die "could not bind free ports after 3 attempts"
}

# Stops every node of DIR: SIGTERM to all together (stopped one by one, the last ones would wait
# out their controlled shutdown for a controller quorum that is already gone), SIGKILL fallback.
stop_nodes() {
  local dir="$1" n i; n="$(cluster_size "$dir")"
  for ((i = 1; i <= n; i++)); do
    end_watchdog "$dir" "$i"
    if node_running "$dir" "$i"; then kill -TERM "$(cat "$(node_dir "$dir" "$i")/pid")" 2>/dev/null || true; fi
  done
  for ((i = 1; i <= n; i++)); do end_node "$dir" "$i" TERM; done
  rm -f "$dir/bootstrap"
  log "$n-node cluster in $dir stopped"
}

# The addresses of the nodes that run now (a tool given a dead node first waits on it).
live_bootstrap() {
  local dir="$1" n i out=(); n="$(cluster_size "$dir")"
  for ((i = 1; i <= n; i++)); do
    if node_running "$dir" "$i"; then out+=("127.0.0.1:$(node_port "$dir" "broker.$i")"); fi
  done
  (( ${#out[@]} > 0 )) || die "no node of $dir is running"
  local IFS=,; echo "${out[*]}"
}

# Creates topics (name:partitions[:compact]) that are missing, with replication factor min(3, N)
# and min.insync.replicas min(2, N): on the single broker 1 and 1.
create_topics() {
  local dir="$1"; shift
  local n bootstrap spec; n="$(cluster_size "$dir")"; bootstrap="$(live_bootstrap "$dir")"
  local rf=$(( n < 3 ? n : 3 )) isr=$(( n < 2 ? n : 2 ))
  for spec in "$@"; do
    local name parts policy extra=()
    IFS=: read -r name parts policy <<< "$spec"
    [[ -n "$name" && "$parts" =~ ^[1-9][0-9]*$ ]] || die "bad topic spec '$spec': want name:partitions[:compact]"
    case "${policy:-}" in
      "") ;;
      compact) extra=(--config cleanup.policy=compact) ;;
      *) die "bad topic spec '$spec': the third field may only be 'compact'" ;;
    esac
    java -Xmx128m $JVM_OPTS -cp "$LIB/*" -Dlog4j2.configurationFile="$(node_dir "$dir" 1)/tools-log4j2.properties" \
      org.apache.kafka.tools.TopicCommand --bootstrap-server "$bootstrap" --create --if-not-exists \
      --topic "$name" --partitions "$parts" --replication-factor "$rf" \
      --config "min.insync.replicas=$isr" "${extra[@]}" >&2
  done
}

# ---- the single broker: a one-node cluster in DIR ----------------------------------------------

cmd_start() {
  [[ $# -eq 1 ]] || die "usage: kafka.sh start DIR"
  command -v java >/dev/null || die "java not found: install a JDK >= 17"
  SINGLE_BROKER=1
  start_nodes "$(cluster_dir "$1")" 1 renew
}

cmd_stop() {
  [[ $# -eq 1 ]] || die "usage: kafka.sh stop DIR"
  [[ -d "$1" ]] || { log "no such directory $1; nothing to stop"; return 0; }
  SINGLE_BROKER=1
  stop_nodes "$(cd "$1" && pwd)"
}

cmd_topics() {
  [[ $# -ge 2 ]] || die "usage: kafka.sh topics DIR name:partitions[:compact] ..."
  [[ -f "$1/bootstrap" ]] || die "no running broker in $1 (missing $1/bootstrap)"
  SINGLE_BROKER=1
  create_topics "$(cd "$1" && pwd)" "${@:2}"
}

# ---- the replicated cluster ----------------------------------------------------------------------

cluster_start() {
  [[ $# -ge 1 && $# -le 2 ]] || die "usage: kafka.sh cluster start DIR [N]"
  command -v java >/dev/null || die "java not found: install a JDK >= 17"
  local dir; dir="$(cluster_dir "$1")"
  local have; have="$(cluster_size "$dir")"
  local n="${2:-$(( have > 0 ? have : 3 ))}"
  [[ "$n" =~ ^[1-9]$ ]] || die "bad node count '$n': want 1..9"
  (( have == 0 || have == n )) || die "$dir holds a $have-node cluster, not $n"
  start_nodes "$dir" "$n" keep
}

cluster_stop() {
  [[ $# -eq 1 ]] || die "usage: kafka.sh cluster stop DIR"
  [[ -d "$1" ]] || { log "no such directory $1; nothing to stop"; return 0; }
  stop_nodes "$(cd "$1" && pwd)"
}

node_arg() {
  local dir="$1" id="${2:-}" n; n="$(cluster_size "$dir")"
  (( n > 0 )) || die "no cluster in $dir (start one with: kafka.sh cluster start $dir)"
  [[ "$id" =~ ^[0-9]+$ ]] && (( id >= 1 && id <= n )) || die "no node '$id' in $dir (nodes 1..$n)"
}

cluster_node_start() {
  [[ $# -eq 2 ]] || die "usage: kafka.sh cluster node-start DIR ID"
  local dir; dir="$(cluster_dir "$1")"; node_arg "$dir" "$2"
  local node; node="$(node_dir "$dir" "$2")"
  node_running "$dir" "$2" && die "node $2 is already running (pid $(cat "$node/pid"))"
  local started=$SECONDS rc=0
  launch_node "$dir" "$2"
  wait_ready "$node" "$(cat "$node/pid")" "$(node_port "$dir" "broker.$2")" || rc=$?
  if (( rc != 0 )); then
    log_tail "$node"
    end_node "$dir" "$2" KILL
    die "node $2 did not become ready ($rc: 1 = exited, 2 = no start within ${START_TIMEOUT}s)"
  fi
  log "node $2 (pid $(cat "$node/pid")) ready in $((SECONDS - started))s"
}

cluster_status() {
  [[ $# -eq 1 ]] || die "usage: kafka.sh cluster status DIR"
  local dir; dir="$(cluster_dir "$1")"
  local n i; n="$(cluster_size "$dir")"
  (( n > 0 )) || die "no cluster in $dir"
  for ((i = 1; i <= n; i++)); do
    if node_running "$dir" "$i"; then
      echo "$i $(cat "$(node_dir "$dir" "$i")/pid") 127.0.0.1:$(node_port "$dir" "broker.$i")"
    else
      echo "$i down 127.0.0.1:$(node_port "$dir" "broker.$i")"
    fi
  done
}

cluster_topics() {
  [[ $# -ge 2 ]] || die "usage: kafka.sh cluster topics DIR name:partitions[:compact] ..."
  create_topics "$(cluster_dir "$1")" "${@:2}"
}

cluster_describe() {
  [[ $# -eq 2 ]] || die "usage: kafka.sh cluster describe DIR TOPIC"
  local dir; dir="$(cluster_dir "$1")"
  java -Xmx128m $JVM_OPTS -cp "$LIB/*" -Dlog4j2.configurationFile="$(node_dir "$dir" 1)/tools-log4j2.properties" \
    org.apache.kafka.tools.TopicCommand --bootstrap-server "$(live_bootstrap "$dir")" --describe --topic "$2"
}

cmd_cluster() {
  local sub="${1:-}" d
  shift || true
  case "$sub" in
    start) cluster_start "$@" ;;
    stop) cluster_stop "$@" ;;
    node-stop)
      [[ $# -eq 2 ]] || die "usage: kafka.sh cluster node-stop DIR ID"
      d="$(cluster_dir "$1")"; node_arg "$d" "$2"; end_node "$d" "$2" TERM ;;
    node-kill)
      [[ $# -eq 2 ]] || die "usage: kafka.sh cluster node-kill DIR ID"
      d="$(cluster_dir "$1")"; node_arg "$d" "$2"; end_node "$d" "$2" KILL ;;
    node-start) cluster_node_start "$@" ;;
    status) cluster_status "$@" ;;
    topics) cluster_topics "$@" ;;
    describe) cluster_describe "$@" ;;
    *) die "usage: kafka.sh cluster {start DIR [N]|stop DIR|node-stop DIR ID|node-kill DIR ID|node-start DIR ID|status DIR|topics DIR SPEC ...|describe DIR TOPIC}" ;;
  esac
}

case "${1:-}" in
  fetch) shift; cmd_fetch "$@" ;;
  start) shift; cmd_start "$@" ;;
  stop) shift; cmd_stop "$@" ;;
  topics) shift; cmd_topics "$@" ;;
  cluster) shift; cmd_cluster "$@" ;;
  *) die "usage: kafka.sh {fetch|start DIR|stop DIR|topics DIR name:partitions[:compact] ...|cluster ...}" ;;
esac
