// Module hooks for the unit tests: resolve the SDK's WIT imports
// (`dtq:handler/<interface>@0.2.0`) to the stand-ins in host/, so that the
// SDK runs in an ordinary Node.js.

export async function resolve(specifier, context, next) {
  const wit = /^dtq:handler\/([a-z-]+)@/.exec(specifier);
  if (wit) {
    return { url: new URL(`./host/${wit[1]}.mjs`, import.meta.url).href, shortCircuit: true };
  }
  return next(specifier, context);
}
