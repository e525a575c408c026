// Reads a UI message stream (the SSE body of the HTTP API's chat answer) from a
// file or stdin and parses it with the `ai` package's own parser, so that a chunk
// the AI SDK would reject fails our suite rather than a person's browser.
//
// Usage: node parse_ui_stream.mjs [--ai 6|7] [FILE]
//
// Prints the final UIMessage as JSON on stdout. Exits 1 when the package rejects
// a chunk (schema or order), when the body has no chunk at all, or when it does
// not end with `data: [DONE]`; exits 2 on bad arguments. Error chunks
// (`{"type":"error"}`) are valid in the protocol: their texts go to stderr.
import { readFile } from "node:fs/promises";

const versions = { 6: "ai", 7: "ai7" };

function fail(code, line) {
  process.stderr.write(`${line}\n`);
  process.exit(code);
}

function parseArguments(argv) {
  let major = "6";
  let file = null;
  for (let index = 0; index < argv.length; index += 1) {
    const argument = argv[index];
    if (argument === "--ai") {
      major = argv[index + 1];
      index += 1;
    } else if (file === null && !argument.startsWith("--")) {
      file = argument;
    } else {
      fail(2, `unexpected argument: ${argument}`);
    }
  }
  if (!(major in versions)) {
    fail(2, `--ai takes 6 or 7, not ${major}`);
  }
  return { module: versions[major], file };
}

async function readBody(file) {
  if (file !== null) {
    return readFile(file);
  }
  const pieces = [];
  for await (const piece of process.stdin) {
    pieces.push(piece);
  }
  return Buffer.concat(pieces);
}

const { module, file } = parseArguments(process.argv.slice(2));
const ai = await import(module);
const body = await readBody(file);

// The package ignores the terminator, but a client waits for it: check it here.
const events = body.toString("utf8").trimEnd().split(/\r?\n\r?\n/);
if (events.at(-1)?.trim() !== "data: [DONE]") {
  fail(1, "the stream does not end with data: [DONE]");
}

const bytes = new ReadableStream({
  start(controller) {
    controller.enqueue(new Uint8Array(body));
    controller.close();
  },
});

const rejected = [];
const errorTexts = new Set();
let chunkCount = 0;
const chunks = ai
  .parseJsonEventStream({ stream: bytes, schema: ai.uiMessageChunkSchema })
  .pipeThrough(
    new TransformStream({
      transform(result, controller) {
        if (!result.success) {
          rejected.push(`rejected chunk ${JSON.stringify(result.rawValue)}: ${result.error.message.split("\n")[0]}`);
          return;
        }
        chunkCount += 1;
        if (result.value.type === "error") {
          errorTexts.add(result.value.errorText);
          process.stderr.write(`error chunk: ${result.value.errorText}\n`);
        }
        controller.enqueue(result.value);
      },
    }),
  );

let message = null;
try {
  for await (const snapshot of ai.readUIMessageStream({
    stream: chunks,
    onError(error) {
      if (!errorTexts.has(error.message)) {
        rejected.push(`the package refused the stream: ${error.message}`);
      }
    },
  })) {
    message = snapshot;
  }
} catch (error) {
  rejected.push(`the package refused the stream: ${error.message}`);
}

if (rejected.length > 0) {
  fail(1, rejected.join("\n"));
}
if (chunkCount === 0 || message === null) {
  fail(1, "the stream holds no UI message");
}
process.stdout.write(`${JSON.stringify(message)}\n`);
