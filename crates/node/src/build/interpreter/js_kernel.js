"use strict";
// The JavaScript and TypeScript kernel of the code-interpreter-v1 template (`--js` for
// JavaScript): tslab's converter (TypeScript's compiler, which type-checks a cell against the
// declarations of the cells before it, keeps top-level declarations between cells, allows
// top-level await and turns `import` into `require`), run here with the Jupyter messages
// E2B's SDKs read: the last expression's value as the main result (`execute_result`), an
// exception as an `error` with name, value and stack, console output as streams.
//
// Usage: node js_kernel.js [--js] CONNECTION_FILE. ZeroMQ comes from the npm package
// `zeromq` (its prebuilt addon); `ipc` endpoints are `<ip>-<port>`, as Jupyter names them.

const crypto = require("node:crypto");
const fs = require("node:fs");
const Module = require("node:module");
const path = require("node:path");
const util = require("node:util");
const vm = require("node:vm");

const zmq = require("zeromq");
const { createConverter } = require("tslab/dist/converter");

const isJS = process.argv.includes("--js");
const connectionFile = process.argv[process.argv.length - 1];
const conn = JSON.parse(fs.readFileSync(connectionFile, "utf8"));
const DELIMITER = "<IDS|MSG>";
const session = crypto.randomUUID();
const language = isJS ? "javascript" : "typescript";

// Our own diagnostics, never through the redirected streams.
const realStderrWrite = process.stderr.write.bind(process.stderr);
function log(...args) {
  realStderrWrite(`js_kernel: ${util.format(...args)}\n`);
}

function endpoint(port) {
  return conn.transport === "ipc" ? `ipc://${conn.ip}-${port}` : `tcp://${conn.ip}:${port}`;
}

function sign(parts) {
  if (!conn.key) return "";
  const hmac = crypto.createHmac("sha256", conn.key);
  for (const part of parts) hmac.update(part);
  return hmac.digest("hex");
}

function parse(frames) {
  const at = frames.findIndex((f) => f.toString() === DELIMITER);
  if (at < 0 || frames.length < at + 6) return null;
  const [signature, header, parent, metadata, content] = frames.slice(at + 1, at + 6);
  if (conn.key) {
    const expected = Buffer.from(sign([header, parent, metadata, content]));
    const given = Buffer.from(signature.toString());
    if (expected.length !== given.length || !crypto.timingSafeEqual(expected, given)) {
      log("dropped a message with a bad signature");
      return null;
    }
  }
  return {
    ids: frames.slice(0, at),
    header: JSON.parse(header.toString()),
    content: JSON.parse(content.toString()),
  };
}

function frames(parent, msgType, content) {
  const header = {
    msg_id: crypto.randomUUID(),
    session,
    username: "kernel",
    date: new Date().toISOString(),
    msg_type: msgType,
    version: "5.3",
  };
  const parts = [header, parent ? parent.header : {}, {}, content].map((p) => JSON.stringify(p));
  return [DELIMITER, sign(parts), ...parts];
}

// A socket sends one message at a time.
function sender(socket) {
  let last = Promise.resolve();
  return (message) => {
    last = last.then(() => socket.send(message)).catch((e) => log("send failed:", e));
    return last;
  };
}

const shell = new zmq.Router();
const control = new zmq.Router();
const iopub = new zmq.Publisher();
const stdin = new zmq.Router();
const heartbeat = new zmq.Reply();
const sendShell = sender(shell);
const sendControl = sender(control);
const sendIopub = sender(iopub);

function publish(parent, msgType, content) {
  return sendIopub([Buffer.from(msgType), ...frames(parent, msgType, content)]);
}

function reply(send, request, msgType, content) {
  return send([...request.ids, ...frames(request, msgType, content)]);
}

// Console output goes to the execution running, or to the last one (as Python's kernel does
// with output that comes later).
let outputParent = null;
for (const name of ["stdout", "stderr"]) {
  process[name].write = (chunk, encoding, callback) => {
    const text = typeof chunk === "string" ? chunk : Buffer.from(chunk).toString("utf8");
    if (outputParent) {
      publish(outputParent, "stream", { name, text });
    } else {
      realStderrWrite(text);
    }
    const done = typeof encoding === "function" ? encoding : callback;
    if (typeof done === "function") done();
    return true;
  };
}
process.on("uncaughtException", (e) => console.error("Uncaught", e));
process.on("unhandledRejection", (e) => console.error("Unhandled promise rejection:", e));

// The executor, as tslab's: each cell is a module whose exports hold its top-level
// declarations, which later cells read through `exports`.
const converter = createConverter({ isJS, isBrowser: false });
let previousDeclarations = "";
const exported = {};
const exportsProxy = new Proxy(exported, {
  // TypeScript turns named imports into getters; they are kept as values, so rewritable.
  defineProperty: (_target, prop, attributes) => {
    if (prop !== "__esModule") {
      exported[prop] = attributes.get ? attributes.get() : attributes.value;
    }
    return true;
  },
});
const requireFromCwd = Module.createRequire(path.join(process.cwd(), "__kernel__.js"));
vm.runInThisContext("(x) => { globalThis.__tslab__ = x; }")({
  exports: exportsProxy,
  require: requireFromCwd,
});

let interruptExecution = () => {};
process.on("SIGINT", () => interruptExecution());

class CompileError extends Error {}

async function run(code) {
  const converted = converter.convert(previousDeclarations, code);
  if (converted.diagnostics.length > 0) {
    const lines = converted.diagnostics.map(
      (d) => `${d.start.line + 1}:${d.start.character + 1} - ${d.messageText}`,
    );
    const error = new CompileError(lines[0]);
    error.name = isJS ? "SyntaxError" : "TSError";
    error.stack = lines.join("\n");
    throw error;
  }
  if (!converted.output) {
    previousDeclarations = converted.declOutput || "";
    return { shown: false };
  }
  const prefix = converted.hasToplevelAwait
    ? "(async function(exports, require) { "
    : "(function(exports, require) { ";
  const wrapped = `${prefix}${converted.output}\n})(__tslab__.exports, __tslab__.require)`;
  const returned = vm.runInThisContext(wrapped, { breakOnSigint: true });
  if (converted.hasToplevelAwait) {
    await new Promise((resolve, reject) => {
      interruptExecution = () => reject(new Error("Interrupted"));
      returned.then(resolve, reject);
    }).finally(() => {
      interruptExecution = () => {};
    });
  }
  previousDeclarations = converted.declOutput || "";
  const last = converted.lastExpressionVar;
  if (last && Object.prototype.hasOwnProperty.call(exported, last)) {
    const value = exported[last];
    delete exported[last];
    if (value !== undefined) return { shown: true, value };
  }
  return { shown: false };
}

// The stack's frames of this kernel and of `node:vm` say nothing about the user's code.
function ownFrame(line) {
  return /^\s+at /.test(line) && (line.includes(__filename) || /\(node:vm:|sigintHandlersWrap/.test(line));
}

function describe(e) {
  if (e instanceof Error) {
    const name = e.name || "Error";
    const stack = typeof e.stack === "string" ? e.stack : `${name}: ${e.message}`;
    return { ename: name, evalue: e.message, traceback: stack.split("\n").filter((l) => !ownFrame(l)) };
  }
  return { ename: "Error", evalue: util.inspect(e), traceback: [`Uncaught ${util.inspect(e)}`] };
}

function mimeBundle(value) {
  return { "text/plain": util.inspect(value, { colors: false, depth: 4 }) };
}

let executionCount = 0;
let executions = Promise.resolve();

async function execute(request) {
  const { code = "", silent = false, store_history: storeHistory = !silent } = request.content;
  await publish(request, "status", { execution_state: "busy" });
  if (storeHistory) executionCount += 1;
  const count = executionCount;
  if (!silent) await publish(request, "execute_input", { code, execution_count: count });
  outputParent = request;
  let content;
  try {
    const result = await run(code);
    if (result.shown && !silent) {
      await publish(request, "execute_result", {
        execution_count: count,
        data: mimeBundle(result.value),
        metadata: {},
      });
    }
    content = { status: "ok", execution_count: count, user_expressions: {}, payload: [] };
  } catch (e) {
    const error = describe(e);
    await publish(request, "error", error);
    content = { status: "error", execution_count: count, ...error };
  }
  await reply(sendShell, request, "execute_reply", content);
  await publish(request, "status", { execution_state: "idle" });
}

const kernelInfo = {
  status: "ok",
  protocol_version: "5.3",
  implementation: "sandbar-js-kernel",
  implementation_version: "1.0.0",
  language_info: isJS
    ? { name: "javascript", version: process.versions.node, mimetype: "text/javascript", file_extension: ".js" }
    : { name: "typescript", version: "5.0", mimetype: "text/typescript", file_extension: ".ts" },
  banner: `${language} on Node.js ${process.version} (tslab's compiler)`,
  help_links: [],
};

async function answer(send, request) {
  const type = request.header.msg_type;
  switch (type) {
    case "execute_request":
      executions = executions.then(() => execute(request)).catch((e) => log("execution failed:", e));
      return;
    case "kernel_info_request":
      await publish(request, "status", { execution_state: "busy" });
      await reply(send, request, "kernel_info_reply", kernelInfo);
      await publish(request, "status", { execution_state: "idle" });
      return;
    case "is_complete_request":
      await reply(send, request, "is_complete_reply", { status: "unknown" });
      return;
    case "complete_request":
      await reply(send, request, "complete_reply", {
        status: "ok",
        matches: [],
        cursor_start: request.content.cursor_pos || 0,
        cursor_end: request.content.cursor_pos || 0,
        metadata: {},
      });
      return;
    case "inspect_request":
      await reply(send, request, "inspect_reply", { status: "ok", found: false, data: {}, metadata: {} });
      return;
    case "comm_info_request":
      await reply(send, request, "comm_info_reply", { status: "ok", comms: {} });
      return;
    case "interrupt_request":
      interruptExecution();
      await reply(send, request, "interrupt_reply", { status: "ok" });
      return;
    case "shutdown_request":
      await reply(send, request, "shutdown_reply", { status: "ok", restart: !!request.content.restart });
      process.exit(0);
      return;
    default:
      log("ignored a", type);
  }
}

async function serve(socket, send) {
  for await (const message of socket) {
    const request = parse(message);
    if (request) answer(send, request).catch((e) => log("cannot answer:", e));
  }
}

async function main() {
  await Promise.all([
    shell.bind(endpoint(conn.shell_port)),
    control.bind(endpoint(conn.control_port)),
    iopub.bind(endpoint(conn.iopub_port)),
    stdin.bind(endpoint(conn.stdin_port)),
    heartbeat.bind(endpoint(conn.hb_port)),
  ]);
  (async () => {
    for await (const [ping] of heartbeat) await heartbeat.send(ping);
  })().catch((e) => log("heartbeat stopped:", e));
  await Promise.all([serve(shell, sendShell), serve(control, sendControl)]);
}

main().catch((e) => {
  log("cannot serve:", e);
  process.exit(1);
});
