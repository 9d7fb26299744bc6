// Stand-ins for the imports the SDK loads but these tests do not call.
const absent = () => {
  throw new Error('not in the unit tests');
};
export const begin = absent;
export const commit = absent;
export const abort = absent;
export const getResult = absent;
