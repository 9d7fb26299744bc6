// A stand-in for the host's `log` import.
export function write() {}
