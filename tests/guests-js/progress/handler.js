// `progress` (JavaScript): the twin of `tests/guests/progress`, for its
// `reports` operation.
//
// Payload → result: `{"reports": [[F, M], [F, M, N], ...]}` →
// `{"reported": n}`, after reporting each pair in order: fraction `F` (a
// number, or `"nan"`, `"inf"`, `"-inf"`) and message `M`, repeated `N` times
// when given.

import { FatalError, progress, task } from 'dtq';

const NAMED = { nan: NaN, inf: Infinity, '-inf': -Infinity };

task('progress', (payload) => {
  const reports = payload.reports ?? [];
  for (const entry of reports) {
    if (entry.length < 2 || typeof entry[1] !== 'string') {
      throw new FatalError('a report is [fraction, message] or [fraction, message, times]');
    }
    const fraction = typeof entry[0] === 'string' ? NAMED[entry[0]] : entry[0];
    progress(fraction, entry[1].repeat(entry[2] ?? 1));
  }
  return { reported: reports.length };
});
