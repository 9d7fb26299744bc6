// Compiled, never run: the declarations in index.d.ts cover how the README
// and the smoke test use the client (tsc --noEmit --strict).
import { Client, DtqError, WaitTimeout, type DtqEvent, type Task } from "dtq-client";

async function main(): Promise<void> {
  const dtq = new Client({ url: "http://localhost:8080", token: null, timeoutMs: 5000 });
  const { task_id, duplicate } = await dtq.submit("default", "echo", { n: 1 }, { idempotencyKey: "order-1", runAt: new Date() });
  const task: Task = await dtq.wait("default", task_id, { timeoutMs: 30_000 });
  console.log(duplicate, task.status, task.result);
  const batch = await dtq.submitBatch("default", [{ task: "echo", payload: [1], maxAttempts: 2 }]);
  for (const { status, body } of batch.results) console.log(status, "task_id" in body ? body.task_id : body.error.code);
  await dtq.cancel("default", task_id);
  for await (const event of dtq.events("default", { since: "0", taskId: task_id })) {
    const e: DtqEvent = event;
    console.log(e.id, e.event, e.status);
    break;
  }
  try {
    await dtq.status("default", "nope");
  } catch (e) {
    if (e instanceof WaitTimeout) console.log(e.details.task_id);
    else if (e instanceof DtqError) console.log(e.code, e.status, e.details);
  }
}

void main();
