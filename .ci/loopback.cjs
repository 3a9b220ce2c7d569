// Preloaded into kinesis-mock (`node --require loopback.cjs main.js`): kinesis-mock has no
// bind-address setting and listens on 0.0.0.0, so every listen() on the wildcard address (or
// with no host) is redirected to 127.0.0.1.
"use strict";
const net = require("net");
const original = net.Server.prototype.listen;
const wildcard = (h) => h === undefined || h === null || h === "" || h === "0.0.0.0" || h === "::";
net.Server.prototype.listen = function (...args) {
  if (args.length > 0 && typeof args[0] === "object" && args[0] !== null && !Array.isArray(args[0])) {
    if (wildcard(args[0].host) && args[0].path === undefined) {
      args[0] = { ...args[0], host: "127.0.0.1" };
    }
  } else if (typeof args[0] === "number" || typeof args[0] === "string" && /^\d+$/.test(args[0])) {
    if (typeof args[1] !== "string" || wildcard(args[1])) {
      const rest = typeof args[1] === "string" ? args.slice(2) : args.slice(1);
      args = [args[0], "127.0.0.1", ...rest];
    }
  }
  return original.apply(this, args);
};
