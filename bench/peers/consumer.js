'use strict';
// One consumer process of drain.js. It lives for all the rounds of one
// configuration (so later rounds run on warmed-up code, as the dtq worker's
// later rounds do) and obeys its parent over the IPC channel:
//
//   {type: 'prepare'}  make a consumer (connected, not taking jobs) → 'ready'
//   {type: 'start'}    take jobs; completions are counted here, in process
//   {type: 'stop'}     close the consumer → 'done' with the count, the ids,
//                      the time of the last completion and the process's
//                      CPU time from 'start' to 'stop' (user + system)
//
// Progress goes to the parent every 20 ms while it changes: one IPC message
// per interval, never one per job. Times are process.hrtime (CLOCK_MONOTONIC,
// the same clock in every process of the machine).

const systems = require('./systems');

const [systemName, portText, concurrencyText] = process.argv.slice(2);
const system = systems[systemName];
const port = Number(portText);
const concurrency = Number(concurrencyText);

function fail(err) {
  const message = (err && (err.stack || err.message)) || String(err);
  if (process.connected) {
    process.send({ type: 'error', message }, () => process.exit(1));
  } else {
    console.error(message);
    process.exit(1);
  }
}
process.on('uncaughtException', fail);
process.on('unhandledRejection', fail);
// The parent is gone: nothing left to report to.
process.on('disconnect', () => process.exit(2));

if (!system || !(port > 0) || !(concurrency > 0)) {
  fail(new Error(`usage: consumer.js <${Object.keys(systems).join('|')}> <port> <concurrency>`));
}

let consumer = null;
let count = 0;
let ids = [];
let lastAt = 0n;
let startedAt = 0n;
let cpuAtStart = null;
let reported = -1;
let ticker = null;

function onCompleted(id) {
  count += 1;
  ids.push(id);
  lastAt = process.hrtime.bigint();
}

function report() {
  if (count !== reported) {
    reported = count;
    process.send({ type: 'progress', count });
  }
}

process.on('message', async (msg) => {
  try {
    switch (msg.type) {
      case 'prepare':
        count = 0;
        ids = [];
        lastAt = 0n;
        reported = -1;
        consumer = await system.consumer(port, concurrency, onCompleted);
        process.send({ type: 'ready' });
        break;
      case 'start':
        startedAt = process.hrtime.bigint();
        cpuAtStart = process.cpuUsage();
        consumer.start();
        ticker = setInterval(report, 20);
        break;
      case 'stop': {
        clearInterval(ticker);
        const cpu = process.cpuUsage(cpuAtStart);
        const at = lastAt;
        await consumer.close();
        consumer = null;
        process.send({
          type: 'done',
          count,
          ids,
          startedAt: startedAt.toString(),
          lastAt: at.toString(),
          cpuS: (cpu.user + cpu.system) / 1e6,
        });
        break;
      }
      default:
        throw new Error(`unknown message ${JSON.stringify(msg)}`);
    }
  } catch (err) {
    fail(err);
  }
});

process.send({ type: 'alive' });
