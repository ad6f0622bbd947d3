# Host simulation of the fused FP8 forward's index math (lab branch): every (row, 16-column vector)
# visited once per phase, every qy_t (row, 16-row segment) written once, no two units of a step
# on the same shared-memory address, the layout within the opt-in shared memory. Mirrors
# plan_fused_forward (fp8_norm_cuda.cu) and fused_forward_kernel; run: python3 this file.
import itertools, math
def tile_word(r,w): return r*32 + (w ^ (((r>>4)&7)<<2))
def plan(M,N,SB=16,sms=132,optin=232448,static=128,ring_kb=64,stash_cap=1<<20):
    chunks=M//32; grid=min(sms,chunks); cpb=-(-chunks//grid); max_rows=cpb*32
    assert max_rows<=256
    strips=N//128; log2kr=0 if max_rows<=64 else (1 if max_rows<=128 else 2)
    per_step=4>>log2kr; steps=-(-strips//per_step)
    slot=per_step*(64<<log2kr)*(128+SB)
    budget=optin-static-4*N-max_rows*4
    ring=max(2,min(9,ring_kb*1024//slot)); ring_slots=ring
    if steps*slot<=budget: K=steps; ring_slots=0
    else:
        while ring>2 and budget-ring*slot<slot: ring-=1
        ring_slots=ring; K=min((budget-ring*slot)//slot, steps, stash_cap); assert K>=0
    total=4*N+ (max_rows*4+15)//16*16 + ring_slots*slot + K*slot
    return dict(chunks=chunks,grid=grid,max_rows=max_rows,strips=strips,log2kr=log2kr,per_step=per_step,steps=steps,slot=slot,ring=ring,K=K,total=total,ring_slots=ring_slots)
def check(M,N,**kw):
    L=plan(M,N,**kw); G=L['grid']
    kr=1<<L['log2kr']; mask=kr-1; per=L['per_step']; tile_rows=64<<L['log2kr']; SB=kw.get('SB',16)
    tile_bytes=tile_rows*(128+SB); tile_x=tile_rows*128
    seen=set(); tseen=set()
    for b in range(G):
        c0=L['chunks']*b//G; c1=L['chunks']*(b+1)//G; row0=c0*32; rows=(c1-c0)*32
        assert rows<=L['max_rows'] and rows<=tile_rows
        segs=rows//16
        for st in range(L['steps']):
            addrs=set()
            for tid in range(512):
                rs=tid>>3; vec=tid&7
                for k in range(4):
                    s=st*per+(k>>L['log2kr']); rk=k&mask
                    if rs+64*rk>=rows or s>=L['strips']: continue
                    r=rs+64*rk
                    a=(k>>L['log2kr'])*tile_bytes+4*tile_word(r,vec*4)
                    assert a%16==0 and a+16<=L['slot'] and a+16 <= (k>>L['log2kr'])*tile_bytes+tile_x
                    assert a not in addrs; addrs.add(a)
                    key=(row0+r,s*8+vec); assert key not in seen; seen.add(key)
                # transpose
                if tid < per*32*segs:
                    seg=tid%segs; word=(tid//segs)&31; istr=tid//(32*segs)
                    s=st*per+istr
                    if s<L['strips']:
                        for c in range(4):
                            key=(s*128+4*word+c,row0+16*seg); assert key not in tseen; tseen.add(key)
    assert len(seen)==M*N//16, (len(seen),M*N//16)
    assert len(tseen)==N*M//16
    assert L['total']<=232448-128
    return L
for M,N in [(8192,640),(16384,4096),(8192,8192),(32768,2048),(64,512),(9600,1280),(33728,256),(4096,4096),(2048,2048),(1024,1024),(256,16384),(512,1024),(4224,384)]:
    print(M,N,check(M,N))
print(check(9600,1280,stash_cap=0,ring_kb=8)); print(check(9600,1280,stash_cap=3,ring_kb=200))
