// Minimal client of deepwell.gateway.v1.Chat: streams one chat completion.
//   npm install                      (once, in this directory)
//   node chat.js 127.0.0.1:50061 "Hello!"
// Prints content as it arrives, reasoning on stderr, tool calls as JSON, then the finish line.
'use strict';
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = path.resolve(__dirname, '..', '..', 'protos');
const def = protoLoader.loadSync('deepwell/gateway/v1/chat.proto', {
  includeDirs: [PROTO_ROOT], keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true,
});
const { Chat } = grpc.loadPackageDefinition(def).deepwell.gateway.v1;

const address = process.argv[2] || '127.0.0.1:50061';
const prompt = process.argv[3] || 'Hello!';
const client = new Chat(address, grpc.credentials.createInsecure());
const metadata = new grpc.Metadata();
if (process.env.DEEPWELL_API_KEY) metadata.set('authorization', `Bearer ${process.env.DEEPWELL_API_KEY}`);

const call = client.Complete({ messages: [{ role: 'user', content: prompt }], max_tokens: 256 }, metadata);
call.on('data', (ev) => {
  switch (ev.event) {
    case 'started': console.error(`[request ${ev.started.request_id}, ${ev.started.prompt_tokens} prompt tokens]`); break;
    case 'content_delta': process.stdout.write(ev.content_delta); break;
    case 'reasoning_delta': process.stderr.write(ev.reasoning_delta); break;
    case 'tool_call_end': console.log(`\ntool call: ${JSON.stringify(ev.tool_call_end.call)}`); break;
    case 'finished':
      console.log(`\nfinish_reason: ${ev.finished.finish_reason}` +
        ` (prompt ${ev.finished.usage.prompt_tokens}, completion ${ev.finished.usage.completion_tokens})`);
      break;
    default: break;
  }
});
call.on('error', (err) => { console.error(`error: ${err.code} ${err.details}`); process.exitCode = 1; });
call.on('end', () => client.close());
