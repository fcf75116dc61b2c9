"""The guard's counters in Redis: one Lua script admits, one settles, one installs a rebuilt counter.

Each ceiling is a Redis hash with used (u*) and reserved (r*) requests, tokens and micro-dollars,
plus an `ok` field that says it was built from the ledger. A missing hash (Redis restarted or
flushed, a new period, a new quota) is never treated as zero: the admit script answers "rebuild"
and the caller rebuilds it from the database first. So counters are a cache of the ledger.

Admission is all-or-nothing across every ceiling that applies: the script checks them all, then
reserves on all of them, in one atomic step on the Redis server. A request may bring a second group
of ceilings, its feature's fallback: when a cost limit of the first group says no (and none of its
request or token limits does), the same step checks the fallback's and reserves on those instead.

On a Redis Cluster every key the scripts touch carries the hash tag {ceiling} (ceiling:c:… is stored
as {ceiling}:c:…), so all counters, in-flight hashes and markers share one slot: an admission across
any set of ceilings is still one script on one server, exactly as on one Redis. With wait_replicas,
each admission and settlement waits (WAIT) until that many replicas hold it (fewer when the master
lists fewer); a replica promoted after its master died then holds every reservation the guard
answered (docs/scaling.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import redis
from redis.cluster import RedisCluster
from redis.commands.core import Script

from .redis_clients import cluster_errors_as_redis_errors, node_client, refresh_layout

# KEYS of admit and settle: n counter hashes, then their n in-flight hashes, then the script's marker
# (settle's is followed by the admitted marker, whose life it shortens; admit's by version keys).
# A counter's in-flight hash maps request id → "tokens,cost" reserved by that request. A counter
# releases (and counts as used) only requests in its own in-flight hash: a counter rebuilt from the
# ledger after a request was settled there already counts it as used, and must not count it twice.

# The functions every script below that touches reservations starts with.
COMMON_LUA = """
-- Lua turns -0 into "-0", which HINCRBY rejects; format integers explicitly and skip zeros.
local function incr(key, field, amount)
  if amount ~= 0 then redis.call('HINCRBY', key, field, string.format('%d', amount)) end
end
-- Take the request's reservation ("tokens,cost" in the in-flight hash) out of a counter that holds
-- it; true when it held one.
local function release_held(counter, in_flight, request_id)
  local held = redis.call('HGET', in_flight, request_id)
  if not held then return false end
  local comma = string.find(held, ',')
  redis.call('HDEL', in_flight, request_id)
  incr(counter, 'rr', -1)
  incr(counter, 'rt', 0 - tonumber(string.sub(held, 1, comma - 1)))
  incr(counter, 'rc', 0 - tonumber(string.sub(held, comma + 1)))
  return true
end
"""

ADMIT_LUA = COMMON_LUA + """local v = tonumber(ARGV[12])  -- version keys of the reference rows, after the marker
local n = (#KEYS - 1 - v) / 2
local marker = KEYS[2 * n + 1]
local marker_ttl = tonumber(ARGV[1])
local prompt = tonumber(ARGV[2])
local request_id = ARGV[3]
-- A group: {first counter, last counter, tokens asked, price in, price out}. The first is the
-- request's own feature; the second, when given, its fallback feature.
local n1 = tonumber(ARGV[4])
local groups = {{1, n1, tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])}}
if ARGV[8] == '1' then groups[2] = {n1 + 1, n, tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11])} end
local COUNTERS_FROM = 12
local LIMITS = 5  -- per counter: requests, tokens, cost, ttl, requests in flight at once
if redis.call('EXISTS', marker) == 1 then return {'duplicate'} end
-- The versions of the reference rows (quotas, prices…) the caller computed the ceilings from: when
-- one moved since, nothing is decided here, and the caller reads the rows again with what is current.
if v > 0 then
  local stale, current = false, {'stale'}
  for j = 1, v do
    local version = redis.call('GET', KEYS[2 * n + 1 + j]) or ''
    current[#current + 1] = version
    if version ~= ARGV[COUNTERS_FROM + LIMITS * n + j] then stale = true end
  end
  if stale then return current end
end
local missing = {}
for i = 1, n do
  if redis.call('HEXISTS', KEYS[i], 'ok') == 0 then missing[#missing + 1] = i end
end
if #missing > 0 then
  local reply = {'rebuild'}
  for _, i in ipairs(missing) do reply[#reply + 1] = i end
  return reply
end
-- The ledger row claims this request's reservation from its INSERT on (before this call), so a
-- counter rebuilt from the ledger since may already hold it. Take it out of every counter that
-- does, so that the checks below see the other requests' reservations only: the grant puts it
-- back, a refusal leaves it out. (The marker above rules out a reservation this script made.)
local taken = {}
for i = 1, n do
  if not taken[KEYS[i]] then
    taken[KEYS[i]] = true
    release_held(KEYS[i], KEYS[n + i], request_id)
  end
end
local function limits(i)
  local base = COUNTERS_FROM + (i - 1) * LIMITS
  return tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3]), tonumber(ARGV[base + 4]),
    tonumber(ARGV[base + 5])
end
-- (tokens granted, each counter's state) when every counter of the group has room, else
-- (nil, the refusal). counts_only skips the cost limits.
local function check(group, counts_only)
  local first, last, asked, price_in, price_out = unpack(group)
  local granted = asked
  local state = {}
  for i = first, last do
    local lr, lt, lc, _, lf = limits(i)
    local v = redis.call('HMGET', KEYS[i], 'ur', 'rr', 'ut', 'rt', 'uc', 'rc')
    local ur, rr, ut, rt, uc, rc = tonumber(v[1]) or 0, tonumber(v[2]) or 0, tonumber(v[3]) or 0,
      tonumber(v[4]) or 0, tonumber(v[5]) or 0, tonumber(v[6]) or 0
    state[i] = {ur, rr, ut, rt, uc, rc}
    -- rr is the requests this counter holds a reservation for: those admitted and not yet settled
    -- (this request's own claim was taken out above).
    if lf >= 0 and rr + 1 > lf then return nil, {'refused', i, 'in_flight', 0, rr, lf} end
    if lr >= 0 and ur + rr + 1 > lr then return nil, {'refused', i, 'requests', ur, rr, lr} end
    if lt >= 0 then
      local room = lt - ut - rt - prompt
      if room < 1 then return nil, {'refused', i, 'tokens', ut, rt, lt} end
      if room < granted then granted = room end
    end
    if lc >= 0 and not counts_only then
      local room = (lc - uc - rc) * 1000000 - prompt * price_in
      if room < 0 or (price_in == 0 and price_out == 0 and uc + rc >= lc) then
        return nil, {'refused', i, 'cost', uc, rc, lc}
      end
      if price_out > 0 then
        local fits = math.floor(room / price_out)
        if fits < 1 then return nil, {'refused', i, 'cost', uc, rc, lc} end
        if fits < granted then granted = fits end
      end
    end
  end
  return granted, state
end
local chosen, why = 1, nil
local granted, state = check(groups[1], false)
if not granted then
  local refusal = state
  -- Only money falls back (a cheaper provider or model may still fit); the user's own request and
  -- token caps stay theirs, whichever feature would serve.
  if groups[2] == nil or refusal[3] ~= 'cost' then return refusal end
  local counts_fit, counts_refusal = check(groups[1], true)
  if not counts_fit then return counts_refusal end
  granted, state = check(groups[2], false)
  if not granted then
    local other = state
    return {'refused', refusal[2], refusal[3], refusal[4], refusal[5], refusal[6],
            other[2], other[3], other[4], other[5], other[6]}
  end
  chosen, why = 2, refusal
end
local first, last, _, price_in, price_out = unpack(groups[chosen])
local tokens = prompt + granted
local cost = math.ceil((prompt * price_in + granted * price_out) / 1000000)
local held = string.format('%d,%d', tokens, cost)
local worst, worst_i, worst_metric = -1, 0, ''
for i = first, last do
  local lr, lt, lc, ttl = limits(i)
  incr(KEYS[i], 'rr', 1)
  incr(KEYS[i], 'rt', tokens)
  incr(KEYS[i], 'rc', cost)
  redis.call('EXPIRE', KEYS[i], ttl)
  redis.call('HSET', KEYS[n + i], request_id, held)
  redis.call('EXPIRE', KEYS[n + i], ttl)
  local s = state[i]
  local used = {{lr, s[1] + s[2] + 1, 'requests'}, {lt, s[3] + s[4] + tokens, 'tokens'}, {lc, s[5] + s[6] + cost, 'cost'}}
  for _, l in ipairs(used) do
    if l[1] > 0 then
      local permille = math.floor(1000 * l[2] / l[1])
      if permille > worst then worst, worst_i, worst_metric = permille, i, l[3] end
    end
  end
end
redis.call('SET', marker, 1, 'EX', marker_ttl)
local reply = {'ok', granted, tokens, cost, worst, worst_i, worst_metric, chosen}
if why then
  for k = 2, 6 do reply[#reply + 1] = why[k] end  -- why the first group said no
end
return reply
"""

SETTLE_LUA = COMMON_LUA + """
local n = (#KEYS - 2) / 2
local marker, admitted = KEYS[2 * n + 1], KEYS[2 * n + 2]
if redis.call('EXISTS', marker) == 1 then return 0 end
local request_id = ARGV[2]
local used_tokens, used_cost = tonumber(ARGV[3]), tonumber(ARGV[4])
local count_as_used = ARGV[5] == '1'
for i = 1, n do
  -- Only a counter that holds this request's reservation releases it; one rebuilt from the
  -- ledger since then already counts the request from the ledger.
  if redis.call('HEXISTS', KEYS[i], 'ok') == 1 and release_held(KEYS[i], KEYS[n + i], request_id) then
    if count_as_used then
      incr(KEYS[i], 'ur', 1)
      incr(KEYS[i], 'ut', used_tokens)
      incr(KEYS[i], 'uc', used_cost)
    end
  end
end
redis.call('SET', marker, 1, 'EX', tonumber(ARGV[1]))
-- The ledger row holds the outcome now (it is written before any settle): nothing reads the
-- admitted marker for long any more (see DONE_MARKER_TTL_S).
redis.call('EXPIRE', admitted, tonumber(ARGV[1]))
return 1
"""

# A refused request's reservation, wherever a counter rebuilt between its admit call and its
# refusal's UPDATE took it from the ledger's claim: released, counted as nothing, no marker (a
# refused request id never settles).
RELEASE_LUA = COMMON_LUA + """
local n = #KEYS / 2
local released = 0
for i = 1, n do
  if redis.call('HEXISTS', KEYS[i], 'ok') == 1 and release_held(KEYS[i], KEYS[n + i], ARGV[1]) then
    released = released + 1
  end
end
return released
"""

# KEYS: the counter, its in-flight hash, then the settled marker of each in-flight request read from
# the ledger. A request that settled between that read and this install (its marker is set) was read
# as reserved, and its settle found no counter to release: installing now would hold its reservation
# until the period ends. -1 tells the caller to read the ledger again, where it is settled.
INSTALL_LUA = """
if redis.call('HEXISTS', KEYS[1], 'ok') == 1 then return 0 end
for i = 3, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then return -1 end
end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('HSET', KEYS[1], 'ok', 1, 'ur', ARGV[1], 'ut', ARGV[2], 'uc', ARGV[3], 'rr', ARGV[4], 'rt', ARGV[5], 'rc', ARGV[6])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[7]))
for i = 8, #ARGV, 2 do
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
end
if #ARGV >= 8 then redis.call('EXPIRE', KEYS[2], tonumber(ARGV[7])) end
return 1
"""

class StaleRebuild(Exception):
    """A counter's ledger read saw a request in flight that has settled since: read it again."""


# (Redis key, the value the caller read there, "" for none): what admit() checks before deciding.
Versions = tuple[tuple[str, str], ...]

NO_LIMIT = -1
# How long the scripts' markers live (docs/budgets.md, "How long the markers live"). The admitted
# marker tells reconciliation, for a row a crash left running, whether the admit script granted it:
# reconciliation reads it CEILING_RESERVATION_TTL_S after the row's start at the earliest, and
# later if every worker was down, so it outlives any outage worth surviving. Once the settle script
# ran, the row records the outcome (the ledger is written before every settle) and both markers
# only make a replay answer "already settled" and a repeated admit script "duplicate" (the ledger's
# unique request id refuses a repeated admission first): a few minutes cover the replays that
# follow a settle (the worker's own, reconciliation's after SETTLE_RETRY_AFTER_S), and a replay
# after that changes no counter either (the first settle took the request out of every in-flight
# hash). At 1,000 requests/s that is ~600,000 keys, where two days of both were ~350 million.
ADMITTED_MARKER_TTL_S = 2 * 24 * 3600
DONE_MARKER_TTL_S = 300
LOGICAL_PREFIX = "ceiling"  # how the guard names counters (and the ledger's counter_keys record them)
CLUSTER_PREFIX = "{ceiling}"  # the same names on a cluster: one hash tag, one slot


REPLICA_LIST_TTL_S = 1.0


class NotReplicated(redis.RedisError):
    """The write reached the master but not enough replicas within the wait: the guard fails closed."""


@dataclass(frozen=True)
class Acks:
    acknowledged: int
    needed: int

    @property
    def short(self) -> bool:
        return self.acknowledged < self.needed

    def __str__(self) -> str:
        return f"{self.acknowledged} of {self.needed} replicas"


def replicas_listed(nodes: dict) -> int:
    """How many replicas a master's CLUSTER NODES (as redis-py parses it) lists for itself."""
    me = next(node["node_id"] for node in nodes.values() if "myself" in node["flags"].split(","))
    return sum(1 for node in nodes.values() if node["master_id"] == me)


@dataclass(frozen=True)
class Limits:
    requests: int | None = None
    tokens: int | None = None
    cost_micro_usd: int | None = None
    # Requests admitted and not yet settled, at once: a concurrency cap, not a period's.
    in_flight: int | None = None

    def any(self) -> bool:
        return any(v is not None for v in (self.requests, self.tokens, self.cost_micro_usd, self.in_flight))


@dataclass(frozen=True)
class CounterSpec:
    key: str
    limits: Limits
    ttl_s: int


@dataclass(frozen=True)
class CounterGroup:
    """The ceilings of the feature that would serve, with what it asks and its prices."""

    counters: list[CounterSpec]
    max_tokens: int
    price_in_per_million: int = 0
    price_out_per_million: int = 0


@dataclass(frozen=True)
class Usage:
    requests: int = 0
    tokens: int = 0
    cost_micro_usd: int = 0


@dataclass(frozen=True)
class CounterState:
    used: Usage
    reserved: Usage


@dataclass(frozen=True)
class AdmitResult:
    status: str  # ok | refused | rebuild | duplicate | stale
    granted_tokens: int = 0
    reserved_tokens: int = 0
    reserved_cost_micro_usd: int = 0
    refused_index: int | None = None  # which counter said no (0-based)
    refused_metric: str = ""  # requests | tokens | cost | in_flight
    refused_used: int = 0
    refused_reserved: int = 0
    refused_limit: int = 0
    rebuild_indexes: tuple[int, ...] = ()
    fullest_permille: int = 0  # how full the fullest ceiling is after this admission
    fullest_index: int | None = None
    fullest_metric: str = ""
    fell_back: bool = False  # admitted on the fallback group's ceilings …
    primary_refusal: AdmitResult | None = None  # … because the first group refused this way
    # Refused after the fallback was tried too: why the fallback did not fit (refused_* are the first group's).
    fallback_refusal: AdmitResult | None = None
    versions: tuple[str, ...] = ()  # stale: the values the version keys hold now ("" for none)


class CounterStore:
    """Atomic admit / settle / install against Redis. Knows nothing about Django."""

    def __init__(self, client: redis.Redis | RedisCluster, prefix: str | None = None, *, wait_replicas: int = 0,
                 wait_timeout_ms: int = 50) -> None:
        self.client = client
        self.on_cluster = isinstance(client, RedisCluster)
        self.prefix = prefix or (CLUSTER_PREFIX if self.on_cluster else LOGICAL_PREFIX)  # of the markers
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self._replicas_seen: dict[str, tuple[float, int]] = {}  # server → (when read, replicas listed)
        self._admit = client.register_script(ADMIT_LUA)
        self._settle = client.register_script(SETTLE_LUA)
        self._install = client.register_script(INSTALL_LUA)
        self._release = client.register_script(RELEASE_LUA)

    def admitted_marker(self, request_id: str) -> str:
        return f"{self.prefix}:admitted:{request_id}"

    def settled_marker(self, request_id: str) -> str:
        return f"{self.prefix}:settled:{request_id}"

    def redis_key(self, counter_key: str) -> str:
        """Where a counter the guard names ceiling:c:… lives: the same key on one Redis, {ceiling}:c:…
        on a cluster."""
        if self.on_cluster and counter_key.startswith(LOGICAL_PREFIX + ":"):
            return CLUSTER_PREFIX + counter_key[len(LOGICAL_PREFIX) :]
        return counter_key

    def _run(self, script, keys: list[str], args: list, *, replicated: bool) -> tuple[object, Acks | None]:
        """Run one script; with replicated and wait_replicas, in the same round trip WAIT until the
        replicas that could replace its server hold its writes. (reply, acknowledgements or None)."""
        # Straight to the server that holds the slot (all the keys share it): the cluster client
        # would hash every key of the call again to find what the first one says.
        with cluster_errors_as_redis_errors():
            node = node_client(self.client, keys[0])
        if not (replicated and self.wait_replicas):
            return self._routed(lambda: evalsha(node, script, keys, args)), None

        def script_then_wait():
            needed = self._replicas_to_wait_for(node)
            if not needed:
                return script(keys=keys, args=args, client=node), Acks(0, 0)
            # WAIT counts the writes of its own connection: the script and WAIT share one pipeline.
            with node.pipeline(transaction=False) as pipe:
                script(keys=keys, args=args, client=pipe)
                pipe.execute_command("WAIT", needed, self.wait_timeout_ms)
                reply, acknowledged = pipe.execute()
            return reply, Acks(int(acknowledged), needed)

        return self._routed(script_then_wait)

    def _replicas_to_wait_for(self, node: redis.Redis) -> int:
        """wait_replicas, or fewer when the cluster lists fewer replicas of this master (failed ones
        count: they could still be promoted). None listed, none can take over with an old copy:
        a master promoted by a failover admits at once, and waits again once a replica rejoins.
        The list is read at most once a second per process (CLUSTER NODES)."""
        if not self.on_cluster:
            return self.wait_replicas
        address = node.get_connection_kwargs()
        name = f"{address.get('host')}:{address.get('port')}"
        seen = self._replicas_seen.get(name)
        now = time.monotonic()
        if seen is None or now - seen[0] > REPLICA_LIST_TTL_S:
            seen = self._replicas_seen[name] = (now, replicas_listed(node.execute_command("CLUSTER NODES")))
        return min(self.wait_replicas, seen[1])

    def _routed(self, call):
        # A master that died or a slot that moved: read the layout again before the next call, and
        # let this one fail (the guard refuses it, fail closed; nothing is retried blindly, since
        # an admission whose reply was lost may have run).
        try:
            return call()
        except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.MovedError,
                redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError):
            refresh_layout(self.client)
            raise

    def admit(
        self,
        request_id: str,
        counters: list[CounterSpec],
        *,
        prompt_tokens: int,
        max_tokens: int,
        price_in_per_million: int = 0,
        price_out_per_million: int = 0,
        fallback: CounterGroup | None = None,
        versions: Versions | None = None,
    ) -> AdmitResult:
        """Reserve on every counter, or refuse; indexes in the result count `counters`, then the fallback's.

        versions: (key, value) pairs the limits were computed under (the reference cache's versions);
        when any key holds another value now, nothing is reserved and the result is "stale", with
        the values now held, in the same round trip that would otherwise have admitted.
        """
        primary = CounterGroup(counters, max_tokens, price_in_per_million, price_out_per_million)
        groups = [primary] if fallback is None else [primary, fallback]
        specs = [spec for group in groups for spec in group.counters]
        versions = versions or ()
        args: list = [ADMITTED_MARKER_TTL_S, prompt_tokens, request_id, len(counters), *_group_args(primary)]
        args += ["1", *_group_args(fallback)] if fallback is not None else ["0", 0, 0, 0]
        args.append(len(versions))
        for spec in specs:
            limits = spec.limits
            args += [_limit(limits.requests), _limit(limits.tokens), _limit(limits.cost_micro_usd), spec.ttl_s,
                     _limit(limits.in_flight)]
        args += [value for _, value in versions]
        keys = [self.redis_key(spec.key) for spec in specs]
        keys += [in_flight_key(key) for key in keys]
        keys.append(self.admitted_marker(request_id))
        keys += [key for key, _ in versions]
        reply, acks = self._run(self._admit, keys, args, replicated=True)
        result = _admit_result([_text(item) for item in reply])
        if result.status == "ok" and acks is not None and acks.short:
            # A failover now could promote a replica without this reservation: never serve on it.
            self.settle(request_id, [spec.key for spec in specs], used_tokens=0, used_cost_micro_usd=0,
                        count_as_used=False, replicated=False)
            raise NotReplicated(f"{acks} acknowledged the admission within {self.wait_timeout_ms} ms; it was released")
        return result

    def settle(self, request_id: str, keys: list[str], *, used_tokens: int, used_cost_micro_usd: int,
               count_as_used: bool = True, replicated: bool = True) -> bool:
        """Release the request's reservation on every counter that holds it and count what it used.

        count_as_used=False only releases (a request that never ran). False if already settled.
        NotReplicated when too few replicas hold it: the caller settles again later (a replay on
        the same master changes nothing; on a promoted replica that lost it, it applies).
        """
        keys = [self.redis_key(key) for key in keys]
        reply, acks = self._run(
            self._settle,
            [*keys, *(in_flight_key(key) for key in keys), self.settled_marker(request_id),
             self.admitted_marker(request_id)],
            [DONE_MARKER_TTL_S, request_id, used_tokens, used_cost_micro_usd, "1" if count_as_used else "0"],
            replicated=replicated,
        )
        if acks is not None and acks.short:
            raise NotReplicated(f"{acks} acknowledged the settlement")
        return bool(reply)

    def release_held(self, request_id: str, keys: list[str]) -> int:
        """Release what counters hold for a refused request (see RELEASE_LUA); how many held it."""
        keys = [self.redis_key(key) for key in keys]
        reply, _ = self._run(self._release, [*keys, *(in_flight_key(key) for key in keys)], [request_id],
                             replicated=False)
        return int(reply)

    def admitted(self, request_id: str) -> bool:
        """Whether an admit call granted this request and no settle has run for it for DONE_MARKER_TTL_S
        (its marker: ADMITTED_MARKER_TTL_S from the grant, DONE_MARKER_TTL_S from a settle)."""
        with cluster_errors_as_redis_errors():
            return bool(self._routed(lambda: self.client.exists(self.admitted_marker(request_id))))

    def install(self, key: str, used: Usage, reserved: Usage, ttl_s: int,
                in_flight: dict[str, tuple[int, int]] | None = None) -> bool:
        """Write a counter rebuilt from the ledger, with the reservations it holds, unless another
        process installed it first. StaleRebuild when a request read as in flight has settled since
        (the caller reads the ledger again)."""
        args: list = [used.requests, used.tokens, used.cost_micro_usd, reserved.requests, reserved.tokens, reserved.cost_micro_usd, ttl_s]
        for request_id, (tokens, cost) in (in_flight or {}).items():
            args += [request_id, f"{tokens},{cost}"]
        # Not waited for: an install a failover loses leaves the counter missing, so it is rebuilt;
        # and an admission's WAIT covers every write before it, this install included.
        key = self.redis_key(key)
        markers = [self.settled_marker(request_id) for request_id in in_flight or {}]
        reply, _ = self._run(self._install, [key, in_flight_key(key), *markers], args, replicated=False)
        if reply == -1:
            raise StaleRebuild(f"a request counted as in flight in {key} settled while it was rebuilt")
        return bool(reply)

    def held(self, key: str) -> dict[str, tuple[int, int]]:
        """The reservations a counter holds: request id → (tokens, micro-dollars)."""
        raw = self.client.hgetall(in_flight_key(self.redis_key(key)))
        return {rid.decode(): tuple(int(x) for x in value.decode().split(",")) for rid, value in raw.items()}

    def state(self, key: str) -> CounterState | None:
        values = self.client.hmget(self.redis_key(key), "ok", "ur", "ut", "uc", "rr", "rt", "rc")
        if values[0] is None:
            return None
        ur, ut, uc, rr, rt, rc = (int(v or 0) for v in values[1:])
        return CounterState(Usage(ur, ut, uc), Usage(rr, rt, rc))


def evalsha(node: redis.Redis, script: Script, keys: list[str], args: list):
    """What script(keys=keys, args=args, client=node) does, on one of the node pool's connections,
    without the layers redis-py puts around every command (its retry wrapper, observability hooks,
    response callbacks), which were ~40% of the client's CPU for a script (bench_guard: two a cycle).
    As there, an unknown script (a restarted or new server) is loaded once and sent again."""
    pool = node.connection_pool
    connection = pool.get_connection()  # checks the connection is alive, reconnects if not
    try:
        try:
            return _command(connection, "EVALSHA", script.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            script.sha = _text(_command(connection, "SCRIPT", "LOAD", script.script))
            return _command(connection, "EVALSHA", script.sha, len(keys), *keys, *args)
    finally:
        pool.release(connection)


def _command(connection, *command):
    """One command and its reply; a connection that failed mid-command is closed, as redis-py does
    (an error reply, such as a script's, leaves it usable)."""
    try:
        connection.send_command(*command)
        return connection.read_response()
    except redis.ResponseError:
        raise
    except BaseException:
        connection.disconnect()
        raise


def _group_args(group: CounterGroup) -> list[int]:
    return [group.max_tokens, group.price_in_per_million, group.price_out_per_million]


def _admit_result(reply: list) -> AdmitResult:
    status = reply[0]
    if status == "ok":
        return AdmitResult(
            "ok",
            granted_tokens=reply[1],
            reserved_tokens=reply[2],
            reserved_cost_micro_usd=reply[3],
            fullest_permille=max(0, reply[4]),
            fullest_index=reply[5] - 1 if reply[5] else None,
            fullest_metric=reply[6],
            fell_back=reply[7] == 2,
            primary_refusal=_refusal(reply[8:13]) if reply[7] == 2 else None,
        )
    if status == "refused":
        fallback_refusal = _refusal(reply[6:11]) if len(reply) > 6 else None
        return replace(_refusal(reply[1:6]), fallback_refusal=fallback_refusal)
    if status == "rebuild":
        return AdmitResult("rebuild", rebuild_indexes=tuple(i - 1 for i in reply[1:]))
    if status == "stale":
        return AdmitResult("stale", versions=tuple(reply[1:]))
    return AdmitResult("duplicate")


def _refusal(fields: list) -> AdmitResult:
    """One counter's no: (its 1-based index, metric, used, reserved, limit)."""
    index, metric, used, reserved, limit = fields
    return AdmitResult(
        "refused", refused_index=index - 1, refused_metric=metric, refused_used=used, refused_reserved=reserved,
        refused_limit=limit,
    )


def in_flight_key(counter_key: str) -> str:
    return f"{counter_key}:inflight"


def _limit(value: int | None) -> int:
    return NO_LIMIT if value is None else int(value)


def _text(item):
    return item.decode() if isinstance(item, bytes) else item
