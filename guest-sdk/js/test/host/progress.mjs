// A stand-in for the host's `progress` import.
export function report() {}
