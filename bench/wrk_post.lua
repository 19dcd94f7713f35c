-- POST one JSON body (env BODY) and, with COUNT_EVENTS=1, count SSE "data: {" events
-- per response. done() prints one JSON line that bench/overhead.py parses.
wrk.method = "POST"
wrk.body = os.getenv("BODY")
wrk.headers["Content-Type"] = "application/json"

local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  events = 0
  bad = 0
end

if os.getenv("COUNT_EVENTS") == "1" then
  function response(status, headers, body)
    if status ~= 200 then
      bad = bad + 1
    end
    local _, n = string.gsub(body, "data: {", "")
    events = events + n
  end
end

function done(summary, latency, requests)
  local ev, nbad = 0, 0
  for _, t in ipairs(threads) do
    ev = ev + (t:get("events") or 0)
    nbad = nbad + (t:get("bad") or 0)
  end
  local e = summary.errors
  io.write(string.format(
    '{"requests":%d,"duration_us":%d,"events":%d,"errors":%d,"p50_us":%d,"p99_us":%d,"mean_us":%.1f}\n',
    summary.requests, summary.duration, ev,
    e.connect + e.read + e.write + e.status + e.timeout + nbad,
    latency:percentile(50), latency:percentile(99), latency.mean))
end
