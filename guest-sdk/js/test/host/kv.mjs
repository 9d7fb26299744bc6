// Stand-ins for the imports the SDK loads but these tests do not call.
const absent = () => {
  throw new Error('not in the unit tests');
};
export const get = absent;
export const set = absent;
export const incrBy = absent;
export const del = absent;
export const expire = absent;
export const exists = absent;
