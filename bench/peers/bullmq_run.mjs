// BullMQ's global rate limiter on the peers benchmark's workload (bench/peers.py).
//
//   node bullmq_run.mjs worker  PORT QUEUE INTERVAL_MS RECORD_KEY
//   node bullmq_run.mjs produce PORT QUEUE COUNT BODIES_MS(comma-separated, cycled)
//
// A worker runs one job at a time under the queue's limiter {max: 1, duration: INTERVAL_MS}
// (BullMQ's limiter is global: every worker of the queue shares it). Each job records
// when its body starts (wall clock, microseconds) and sleeps its body time; the worker
// prints "ready" once connected. The producer adds COUNT jobs in one addBulk.
import { Queue, Worker } from "bullmq";
import IORedis from "ioredis";

const [role, port, name, a, b] = process.argv.slice(2);
const connection = { host: "127.0.0.1", port: Number(port), maxRetriesPerRequest: null };
const nowUs = () => Math.round((performance.timeOrigin + performance.now()) * 1000);
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

if (role === "worker") {
  const interval = Number(a);
  const record = new IORedis(connection);
  const worker = new Worker(
    name,
    async (job) => {
      const t = nowUs();
      await record.rpush(b, JSON.stringify({ n: job.data.n, t_us: t, pid: process.pid }));
      if (job.data.body > 0) await sleep(job.data.body);
    },
    { connection, concurrency: 1, limiter: { max: 1, duration: interval }, removeOnComplete: { count: 0 } },
  );
  await worker.waitUntilReady();
  console.log("ready");
  process.on("SIGTERM", async () => {
    await worker.close(true);
    process.exit(0);
  });
} else if (role === "produce") {
  const count = Number(a);
  const bodies = b.split(",").map(Number);
  const queue = new Queue(name, { connection });
  const jobs = Array.from({ length: count }, (_, n) => ({ name: "job", data: { n, body: bodies[n % bodies.length] } }));
  await queue.addBulk(jobs);
  await queue.close();
  console.log(`added ${count}`);
  process.exit(0);
} else {
  console.error(`unknown role ${role}`);
  process.exit(2);
}
