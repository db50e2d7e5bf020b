-- wrk script: POST embedding requests built from a pre-generated pool of bodies.
--   BENCH_ROUTE      /v1/embeddings (default), /embeddings, ...
--   BENCH_INPUTS     inputs per request (1)
--   BENCH_MIN_WORDS  BENCH_MAX_WORDS  words per input (10, 10)
--   BENCH_MODEL      the "model" field, for servers that check it ("bench")
--   BENCH_BODIES     a file of request bodies, one JSON body a line, sent in turn instead
--                    of generated ones (bench/run.py writes them, so that its offline
--                    rates are measured on the same inputs)
-- Prints one JSON line at the end: requests, seconds, errors, p50/p90/p99 latency in ms.
local words = {"the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "service",
  "embedding", "vector", "batch", "token", "model", "request", "latency", "search", "query",
  "document", "ranking", "cluster", "semantic", "neural", "network", "python", "thread"}
local route = os.getenv("BENCH_ROUTE") or "/v1/embeddings"
local inputs = tonumber(os.getenv("BENCH_INPUTS") or "1")
local min_words = tonumber(os.getenv("BENCH_MIN_WORDS") or "10")
local max_words = tonumber(os.getenv("BENCH_MAX_WORDS") or "10")
local model = os.getenv("BENCH_MODEL") or "bench"
local pool = {}
local next_body = 1
local thread_id = 0

local function sentence()
  local n = math.random(min_words, max_words)
  local parts = {}
  for i = 1, n do parts[i] = words[math.random(#words)] end
  return table.concat(parts, " ")
end

function setup(thread)
  thread_id = thread_id + 1
  thread:set("seed", thread_id)
end

function init(args)
  local bodies = os.getenv("BENCH_BODIES")
  if bodies then
    for line in io.lines(bodies) do pool[#pool + 1] = line end
  end
  math.randomseed(os.time() * 1000 + (seed or 0))
  for b = 1, (bodies and 0 or 500) do
    local items = {}
    for i = 1, inputs do items[i] = '"' .. sentence() .. " " .. b .. '"' end
    pool[b] = '{"model": "' .. model .. '", "input": [' .. table.concat(items, ", ") .. ']}'
  end
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
end

function request()
  local body = pool[next_body]
  next_body = next_body % #pool + 1
  return wrk.format("POST", route, nil, body)
end

function done(summary, latency, requests)
  local errors = summary.errors.connect + summary.errors.read + summary.errors.write
    + summary.errors.status + summary.errors.timeout
  io.write(string.format(
    '{"requests": %d, "seconds": %.3f, "errors": %d, "p50_ms": %.2f, "p90_ms": %.2f, "p99_ms": %.2f}\n',
    summary.requests, summary.duration / 1e6, errors, latency:percentile(50) / 1000,
    latency:percentile(90) / 1000, latency:percentile(99) / 1000))
end
