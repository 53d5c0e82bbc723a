// BullMQ on the peers benchmark's workloads (bench/peers.py).
//
//   node bullmq_run.mjs worker  PORT QUEUE INTERVAL_MS RECORD_KEY [MAX]
//   node bullmq_run.mjs capped  PORT QUEUE CONCURRENCY RECORD_KEY IN_FLIGHT_KEY
//   node bullmq_run.mjs produce PORT QUEUE COUNT BODIES_MS(comma-separated, cycled) [GLOBAL_CONCURRENCY]
//
// "worker" runs one job at a time under the queue's limiter {max: MAX, duration: MAX x
// INTERVAL_MS} (MAX 1 by default: one start per interval; BullMQ's limiter is global: every
// worker of the queue shares it). Each job records when its body starts (wall clock,
// microseconds) and sleeps its body time.
// "capped" runs up to CONCURRENCY jobs at once and no limiter; each job counts the bodies
// running (INCR IN_FLIGHT_KEY as it starts, DECR as it ends) and records its start, its
// end and the count it saw. The cap across workers is the queue's global concurrency,
// which the producer sets.
// A worker prints "ready" once connected. The producer sets the queue's global
// concurrency if given (queue.setGlobalConcurrency), then adds COUNT jobs in one addBulk.
import { Queue, Worker } from "bullmq";
import IORedis from "ioredis";

const [role, port, name, a, b, c] = process.argv.slice(2);
const connection = { host: "127.0.0.1", port: Number(port), maxRetriesPerRequest: null };
const nowUs = () => Math.round((performance.timeOrigin + performance.now()) * 1000);
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function serve(processor, options) {
  const worker = new Worker(name, processor, { connection, removeOnComplete: { count: 0 }, ...options });
  await worker.waitUntilReady();
  console.log("ready");
  process.on("SIGTERM", async () => {
    await worker.close(true);
    process.exit(0);
  });
}

if (role === "worker") {
  const interval = Number(a);
  const max = Number(c || 1);
  const record = new IORedis(connection);
  await serve(
    async (job) => {
      const t = nowUs();
      await record.rpush(b, JSON.stringify({ n: job.data.n, t_us: t, pid: process.pid }));
      if (job.data.body > 0) await sleep(job.data.body);
    },
    { concurrency: 1, limiter: { max, duration: max * interval } },
  );
} else if (role === "capped") {
  const record = new IORedis(connection);
  await serve(
    async (job) => {
      const t = nowUs();
      const inFlight = await record.incr(c);
      if (job.data.body > 0) await sleep(job.data.body);
      await record.decr(c);
      const end = nowUs();
      await record.rpush(b, JSON.stringify({ n: job.data.n, t_us: t, end_us: end, in_flight: inFlight }));
    },
    { concurrency: Number(a) },
  );
} else if (role === "produce") {
  const count = Number(a);
  const bodies = b.split(",").map(Number);
  const queue = new Queue(name, { connection });
  if (c) await queue.setGlobalConcurrency(Number(c));
  const jobs = Array.from({ length: count }, (_, n) => ({ name: "job", data: { n, body: bodies[n % bodies.length] } }));
  await queue.addBulk(jobs);
  await queue.close();
  console.log(`added ${count}`);
  process.exit(0);
} else {
  console.error(`unknown role ${role}`);
  process.exit(2);
}
