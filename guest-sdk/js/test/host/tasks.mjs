// A stand-in for the host's `tasks` import: records what it is asked.

export const host = {
  reset() {
    this.submitted = [];
    this.children = [];
    this.waited = 0;
    this.refusal = null;
  },
};
host.reset();

export function submit(queue, task, payload, options) {
  if (host.refusal) throw Object.assign(new Error('host error'), { payload: host.refusal });
  host.submitted.push({ queue, task, payload, options });
  return `id-${host.submitted.length}`;
}

export function children() {
  if (host.refusal) throw Object.assign(new Error('host error'), { payload: host.refusal });
  return host.children;
}

export function waitForChildren() {
  host.waited += 1;
}
