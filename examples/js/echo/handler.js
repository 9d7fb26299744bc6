// `echo`: return the payload unchanged.
//
// The JavaScript twin of `examples/echo`. Payload → result: any JSON value
// `X` → the same `X`, byte for byte. The payload is taken raw (`RawJson`),
// so it is neither parsed nor re-serialized: the handler to measure the
// trip into and out of the sandbox with.

import { task } from 'dtq';

task('echo', { raw: true }, (payload) => payload);
